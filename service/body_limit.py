"""Refuse request bodies over `max_bytes` with a 413 in OpenAI's error shape.

A declared Content-Length over the limit is refused before the body is read; a chunked body is
counted as it arrives and refused once it passes the limit (FastAPI turns the HTTPException
raised from `receive` into the 413 response). Starlette's own limiter answers in plain text.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import APIError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = APIError(413, self._message(), code="body_too_large").response()
            return await response(scope, receive, send)
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"
