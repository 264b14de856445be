"""Turns domain exceptions into gRPC status codes, for every method of a server.

Domain code signals bad input with ValueError subclasses (TreeError, SelectionError,
...) whose messages name the offending field, so servicers stay free of try/except:
ValueError -> INVALID_ARGUMENT with that message; a server may add its own mapping
(the drafter maps KVCacheFull -> RESOURCE_EXHAUSTED); anything else -> INTERNAL,
logged with its traceback. Either way the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

log = logging.getLogger(__name__)


ErrorCodes = Mapping[type[BaseException], grpc.StatusCode]


async def _abort_for(
    exc: Exception, context: grpc.aio.ServicerContext, method: str, codes: ErrorCodes
) -> None:
    for kind, code in codes.items():
        if isinstance(exc, kind):
            await context.abort(code, str(exc) or type(exc).__name__)
    if isinstance(exc, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc) or type(exc).__name__)
    log.exception("%s failed", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class DomainErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, codes: ErrorCodes | None = None) -> None:
        self.codes: ErrorCodes = dict(codes or {})

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method, self.codes),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method, self.codes),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # client-streaming methods handle their own errors


def _wrap_unary(behavior: Callable[..., Any], method: str, codes: ErrorCodes) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(exc, context, method, codes)

    return wrapped


def _wrap_stream(
    behavior: Callable[..., Any], method: str, codes: ErrorCodes
) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in behavior(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(exc, context, method, codes)

    return wrapped
