"""Calling a unary method with a deadline and mapping failures to what the engine
(transport-free) can catch: INVALID_ARGUMENT -> ValueError (the caller's bug, same as
in-process), anything else -> ServiceUnavailable (a ConnectionError: fall back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

Reply = TypeVar("Reply")


class ServiceUnavailable(ConnectionError):
    """The service could not answer (down, overloaded, timed out, internal error)."""

    def __init__(self, service: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{service}: {code.name}: {details}")
        self.code = code


def call(service: str, method: Callable[..., Reply], request: object, timeout_s: float) -> Reply:
    try:
        return method(request, timeout=timeout_s, wait_for_ready=False)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise ValueError(details) from None
        raise ServiceUnavailable(service, code, details) from None
