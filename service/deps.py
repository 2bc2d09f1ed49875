"""Dependencies shared by the routers, as `Annotated` types (STYLE.md §14).

    @router.post("/v1/completions", dependencies=[ApiKey])
    async def completions(body: CompletionRequest, service: ServiceDep): ...

    admin = APIRouter(prefix="/admin", dependencies=[AdminToken])

- `ServiceDep` is the running `Service`; 503 while it starts or drains.
- `ApiKey`: when ADAPTIVE_SPEC_API_KEY is set, /v1 needs `Authorization: Bearer <key>` (401
  otherwise); unset, /v1 is open, which suits the loopback default.
- `AdminToken`: /admin needs `Authorization: Bearer <ADAPTIVE_SPEC_ADMIN_TOKEN>`. With no token
  configured, every admin request is refused (403) with a message saying how to set one.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from service.errors import APIError
from service.runtime import Service


def get_service(request: Request) -> Service:
    service: Service | None = getattr(request.app.state, "service", None)
    if service is None or service.worker.closing:
        raise APIError(503, "the server is starting or shutting down; retry shortly", code="unavailable")
    return service


ServiceDep = Annotated[Service, Depends(get_service)]


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def require_api_key(request: Request) -> None:
    expected = request.app.state.settings.api_key
    if expected is None:
        return
    given = _bearer(request)
    if given is None or not secrets.compare_digest(given.encode(), expected.encode()):
        raise APIError(
            401,
            "missing or wrong API key: send `Authorization: Bearer <ADAPTIVE_SPEC_API_KEY>`",
            type="invalid_request_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_admin(request: Request) -> None:
    expected = request.app.state.settings.admin_token
    if expected is None:
        raise APIError(
            403,
            "the admin API is disabled: set ADAPTIVE_SPEC_ADMIN_TOKEN in the server's environment "
            "and send `Authorization: Bearer <token>`",
            code="admin_disabled",
        )
    given = _bearer(request)
    if given is None or not secrets.compare_digest(given.encode(), expected.encode()):
        raise APIError(
            401,
            "missing or wrong admin token: send `Authorization: Bearer <ADAPTIVE_SPEC_ADMIN_TOKEN>`",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


ApiKey = Depends(require_api_key)
AdminToken = Depends(require_admin)
