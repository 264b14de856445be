"""The gateway's API over gRPC (`adaserve.rpc.v1.Gateway`), for gRPC clients.

Requests go through the same pydantic validation and `GenerateSpec` building as REST,
so both fronts accept and refuse exactly the same things; errors become status codes
(`APIError.grpc_code`). A client deadline becomes the request's timeout, so an
abandoned request is dropped on the verifier too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from pydantic import ValidationError

from adaserve.rpc.v1 import gateway_pb2 as gpb
from adaserve.rpc.v1 import gateway_pb2_grpc as ggrpc
from gateway import spec as specs
from gateway.auth import ApiKeys
from gateway.core import Gateway
from gateway.errors import APIError, from_validation
from gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
from services.common.convert import finish_reason_to_pb, speculation_method_from_pb
from services.common.server import GrpcServer, Service


class GatewayServicer(ggrpc.GatewayServicer):
    def __init__(self, gateway: Gateway, keys: ApiKeys) -> None:
        self.gw = gateway
        self.keys = keys

    async def Complete(
        self, request: gpb.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gpb.CompletionChunk]:
        body = _options(request.options, context)
        which = request.WhichOneof("prompt")
        body["prompt"] = list(request.token_ids.ids) if which == "token_ids" else request.text
        async for chunk in self._run(
            context, "completion", body, CompletionRequest, specs.from_completion
        ):
            yield chunk

    async def ChatComplete(
        self, request: gpb.ChatCompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gpb.CompletionChunk]:
        body = _options(request.options, context)
        body["messages"] = [
            {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
            for m in request.messages
        ]
        async for chunk in self._run(context, "chat", body, ChatCompletionRequest, specs.from_chat):
            yield chunk

    async def ListModels(
        self, request: gpb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gpb.ListModelsResponse:
        await self._authorize(context)
        return gpb.ListModelsResponse(models=self.gw.router.models())

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        try:
            self.keys.check(metadata.get("authorization"))
        except APIError as err:
            await context.abort(err.grpc_code, err.message)

    async def _run(
        self,
        context: grpc.aio.ServicerContext,
        endpoint: str,
        body: dict[str, Any],
        model: type[CompletionRequest] | type[ChatCompletionRequest],
        build: Callable[..., specs.GenerateSpec],
    ) -> AsyncIterator[gpb.CompletionChunk]:
        await self._authorize(context)
        try:
            parsed = model.model_validate(body)
            built = build(parsed, self.gw.settings, {}, self.gw.slo_classes())
            spec = built[0] if isinstance(built, list) else built  # one prompt here
        except ValidationError as exc:
            err = from_validation(exc.errors()[0])
            self.gw.rejected(endpoint, err)
            await context.abort(err.grpc_code, err.message)
        except APIError as err:
            self.gw.rejected(endpoint, err)
            await context.abort(err.grpc_code, err.message)
        try:
            gen = await self.gw.open(spec)
        except APIError as err:
            await _abort(context, err)
        try:
            assert gen.header is not None
            h = gen.header
            async for c in gen.chunks():
                out = gpb.CompletionChunk(
                    id=spec.response_id,
                    model=h.model,
                    token_ids=c.token_ids,
                    text=c.text,
                    best_effort=gen.best_effort,
                    tpot_slo_ms=h.tpot_slo_ms,
                    slo_floor_ms=h.slo_floor_ms or 0.0,
                    best_effort_reason=h.best_effort_reason or "",
                    ttft_slo_ms=h.ttft_slo_ms or 0.0,
                )
                if c.finish_reason is not None:
                    out.finish_reason = finish_reason_to_pb(c.finish_reason)
                    out.usage.CopyFrom(
                        gpb.Usage(
                            prompt_tokens=h.num_prompt_tokens,
                            completion_tokens=c.num_generated,
                            total_tokens=h.num_prompt_tokens + c.num_generated,
                        )
                    )
                yield out
        except APIError as err:
            await _abort(context, err)
        finally:
            await gen.aclose()


def _options(opts: gpb.RequestOptions, context: grpc.aio.ServicerContext) -> dict[str, Any]:
    body: dict[str, Any] = {"priority": opts.priority, "ignore_eos": opts.ignore_eos}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if opts.HasField(name):
            body[name] = getattr(opts, name)
    scalars = {
        "model": opts.model or None,
        "top_k": opts.top_k or None,
        "tpot_slo_ms": opts.tpot_slo_ms or None,
        "ttft_slo_ms": opts.ttft_slo_ms or None,
        "slo_class": opts.slo_class or None,
        "request_id": opts.request_id or None,
        "timeout": opts.timeout_s or None,
        "stop": list(opts.stop) or None,
        "stop_token_ids": list(opts.stop_token_ids) or None,
        "speculation": {"method": _method_name(opts.speculation_method)}
        if opts.speculation_method
        else None,
    }
    body |= {k: v for k, v in scalars.items() if v is not None}
    remaining = context.time_remaining()
    if remaining is not None and remaining > 0:
        body["timeout"] = min(body.get("timeout", remaining), remaining, 86_400.0)
    return body


def _method_name(value: int) -> str:
    """The REST body's method name of a wire enum; an unknown value goes through as a
    name the body's validation refuses (400 / INVALID_ARGUMENT naming the field)."""
    try:
        return speculation_method_from_pb(value) or "auto"
    except ValueError:
        return f"unknown enum value {value}"


async def _abort(context: grpc.aio.ServicerContext, err: APIError) -> None:
    trailing = ()
    if err.retry_after_s is not None:
        trailing = (("retry-after", str(err.retry_after_s)),)
    await context.abort(err.grpc_code, err.message, trailing_metadata=trailing)


class GatewayGrpcServer:
    """The gRPC front on the gateway's own event loop (started by the app's lifespan)."""

    def __init__(self, gateway: Gateway, keys: ApiKeys, host: str, port: int) -> None:
        servicer = GatewayServicer(gateway, keys)
        self._server = GrpcServer(
            [
                Service(
                    "adaserve.rpc.v1.Gateway",
                    lambda s: ggrpc.add_GatewayServicer_to_server(servicer, s),
                )
            ],
            host,
            port,
            max_receive_bytes=gateway.settings.gateway.max_body_bytes,
            public=True,
        )

    async def start(self) -> int:
        return await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(grace_s=1.0)
