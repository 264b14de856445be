"""Request-size limits of the REST front, enforced before a body is buffered.

Headers over `gateway.max_header_bytes` in total are answered 431, a body over
`gateway.max_body_bytes` 413, both in OpenAI's error shape: the body at once when its
Content-Length says so, or as soon as the bytes received pass the limit (chunked
uploads declare no length). The HTTP server's own cap on buffered header bytes
(gateway/__main__.py) bounds what reaches this check.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError


class RequestLimits:
    """Pure ASGI middleware (no buffering of its own, streaming responses untouched)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) for k, v in scope.get("headers", ()))
        if header_bytes > self.max_header_bytes:
            message = f"request headers are larger than {self.max_header_bytes} bytes"
            await _refuse(send, APIError(431, message, code="headers_too_large"))
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(send, APIError(413, self._message(), code="body_too_large"))
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI lets HTTPException through body parsing: the app's own
                    # handler renders it, in the same shape as _refuse.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes"


async def _refuse(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed length itself
    return None
