"""Errors the gateway answers with, in OpenAI's shape.

Every failure the client can see is an `APIError`: the REST front renders it as
`{"error": {"message", "type", "param", "code"}}` with its HTTP status, the gRPC front
as the matching status code. Verifier status codes map here, in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

# HTTP status -> OpenAI error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

_HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        error_type: str | None = None,
    ) -> None:
        """`error_type` overrides the OpenAI type the status implies (OpenAI answers an
        unknown model 404 with type invalid_request_error)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self._type = error_type

    @property
    def type(self) -> str:
        if self._type is not None:
            return self._type
        return _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after_s)))}

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _HTTP_TO_GRPC.get(self.status, grpc.StatusCode.INTERNAL)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    """OpenAI's (and vLLM's) answer to an unknown `model`, word for word."""
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        param="model",
        code="model_not_found",
        error_type="invalid_request_error",
    )


def from_validation(first: Mapping[str, Any], skip: tuple[str, ...] = ()) -> APIError:
    """A pydantic error as a 400 that names the field. Our own checks raise ValueError,
    which pydantic prefixes with "Value error, " (the client gets the check's words), or
    an "unsupported" error for a feature we do not offer (code `unsupported`).
    `skip`: location parts that are not the client's (FastAPI's "body")."""
    loc = [str(p) for p in first.get("loc", ()) if p not in skip]
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    param = ".".join(loc) or None
    code = "unsupported" if first.get("type") == "unsupported" else "invalid_value"
    return bad_request(f"{param}: {msg}" if param else msg, param=param, code=code)


def from_grpc(err: grpc.aio.AioRpcError, unit: str) -> APIError:
    """A verifier's error status as the client should see it. INVALID_ARGUMENT carries
    a message naming the field (bad prompt, context length), so it is passed through."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(details, code="invalid_argument")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(
            429, f"server busy: {details}", code="engine_full", retry_after_s=_retry_after(err)
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(408, "request timed out", code="timeout")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return APIError(503, f"serving unit {unit} unavailable: {details}", code="unavailable")
    return APIError(500, f"serving unit {unit} failed: {code.name}", code="internal_error")


def _retry_after(err: grpc.aio.AioRpcError) -> float:
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after":
            try:
                return float(value)
            except ValueError:
                break
    return 1.0
