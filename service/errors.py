"""Every error the service sends, in OpenAI's shape:

    {"error": {"message": "temperature: Input should be less than or equal to 2",
               "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}

Bad input is a 4xx, never a 5xx: schema errors and the engine's `InputError` are 400, a wrong
model is 404, a body over the limit is 413. The service's own limits are 429 (queue full),
503 (shutting down) and 504 (the request timed out); anything unexpected is a 500 with no
detail beyond its type, and is logged.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from adaptive_spec.engine import InputError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic names union members in `loc`


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def install(app: FastAPI) -> None:
    """Route every exception the app can raise to an OpenAI-shaped JSON response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError) -> JSONResponse:
        return bad_request(str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
        message = f"internal error ({type(exc).__name__}); see the server log"
        return APIError(500, message, code="internal_error").response()


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400: `param` is its dotted location in the body."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    loc = list(first.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    fields = []
    for part in loc:
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):  # a union member's tag, not a field
            break
        fields.append(str(part))
    param = ".".join(fields) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "missing":
        if param is None:
            return bad_request("the request needs a JSON body", code="missing_body")
        return bad_request(f"missing required field: {param}", param, code="missing_field")
    return bad_request(f"{param}: {message}" if param else message, param)
