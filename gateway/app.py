"""The OpenAI-compatible REST front (FastAPI).

`create_app` builds a self-contained app: its lifespan starts the verifier router
(health checks) and, when a gRPC port is given, the gRPC front on the same event loop.
Every error the client sees is OpenAI-shaped (`gateway.errors`); bad input is 400,
never 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from adaserve.config import Settings
from adaserve.rpc.v1 import verifier_pb2 as vpb
from gateway import spec as specs
from gateway.auth import ApiKeys
from gateway.core import Chunk, Gateway, Generation
from gateway.errors import APIError, from_grpc, from_validation
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics
from gateway.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorBody,
    TokenizeRequest,
)
from gateway.responses import DONE_FRAME, Formatter, sse
from gateway.router import Router, Unit
from gateway.spec import check_unknown

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    verifiers: list[str],
    *,
    verifier_dns: str | None = None,
    grpc_port: int | None = None,
    grpc_host: str = "0.0.0.0",
) -> FastAPI:
    keys = ApiKeys.from_settings(settings.gateway)
    Router(verifiers, dns=verifier_dns)  # bad addresses fail here, before serving

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = GatewayMetrics()
        router = Router(
            verifiers,
            dns=verifier_dns,
            interval_s=settings.gateway.health_interval_s,
            fleet=settings.fleet,
            on_route=lambda reason: metrics.routed.labels(reason).inc(),
        )
        await router.start()
        app.state.gateway = Gateway(settings, router, metrics)
        grpc_server = None
        if grpc_port is not None:
            from gateway.grpc_front import GatewayGrpcServer

            grpc_server = GatewayGrpcServer(app.state.gateway, keys, grpc_host, grpc_port)
            app.state.grpc_port = await grpc_server.start()
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop()
            await router.close()

    async def authorize(request: Request) -> None:
        if keys.requires_auth(request.url.path, settings.gateway.metrics_require_auth):
            keys.check(request.headers.get("authorization"))

    app = FastAPI(
        title="adaserve",
        summary="OpenAI-compatible API with per-request TPOT SLOs",
        lifespan=lifespan,
        dependencies=[Depends(authorize)],
    )
    _install_error_handlers(app)
    app.add_middleware(
        RequestLimits,
        max_body_bytes=settings.gateway.max_body_bytes,
        max_header_bytes=settings.gateway.max_header_bytes,
    )
    _openapi_without_422(app)

    errors: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorBody, "description": "invalid request"},
        401: {"model": ErrorBody, "description": "missing or wrong API key"},
        404: {"model": ErrorBody, "description": "no such model (code model_not_found)"},
        408: {"model": ErrorBody, "description": "the request's timeout passed (code timeout)"},
        413: {"model": ErrorBody, "description": "request body too large"},
        431: {"model": ErrorBody, "description": "request headers too large"},
        429: {"model": ErrorBody, "description": "engine full; see Retry-After"},
        503: {"model": ErrorBody, "description": "no healthy serving unit"},
    }
    # The published schema must hold for streams too (the OpenAPI fuzz test checks it).
    generated: dict[int | str, dict[str, Any]] = {
        200: {
            "description": "the completion; with stream=true, server-sent events",
            "content": {"application/json": {}, "text/event-stream": {}},
        }
    }

    @app.post("/v1/completions", responses=errors | generated)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        built = _build(
            gw,
            "completion",
            lambda: specs.from_completion(body, settings, request.headers, gw.slo_classes()),
        )
        shape = _Shape(body.stream, body.include_usage, body.n, body.logprobs is not None)
        return await _serve(request, gw, built, shape)

    @app.post("/v1/chat/completions", responses=errors | generated)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        spec = _build(
            gw, "chat", lambda: specs.from_chat(body, settings, request.headers, gw.slo_classes())
        )
        shape = _Shape(body.stream, body.include_usage, body.n, body.logprobs)
        return await _serve(request, gw, [spec], shape)

    @app.post("/tokenize", responses=errors)
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt or chat messages (the unit's chat template) to the
        unit's token ids."""
        gw: Gateway = request.app.state.gateway
        check_unknown(body, settings)
        resp = await _unit_call(gw, body.model, "Tokenize", specs.tokenize_pb(body))
        return {
            "count": len(resp.ids),
            "max_model_len": resp.max_model_len,
            "tokens": list(resp.ids),
            "token_strs": list(resp.pieces) if body.return_token_strs else None,
        }

    @app.post("/detokenize", responses=errors)
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: token ids to text (special tokens kept)."""
        gw: Gateway = request.app.state.gateway
        check_unknown(body, settings)
        resp = await _unit_call(
            gw, body.model, "Detokenize", vpb.DetokenizeRequest(ids=body.tokens)
        )
        return {"prompt": resp.text}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """OpenAI's model list, plus each model's max_model_len, `quantization` and `slo` (as in
        /v1/slo, from the first of its healthy units by address, with each class's TPOT
        the fleet's: what a request of that class is given, whichever unit serves it)."""
        router: Router = request.app.state.gateway.router
        seen: dict[str, vpb.InfoResponse] = {}
        for unit in sorted(router.healthy(), key=lambda u: u.address):
            if unit.info:
                seen.setdefault(unit.info.served_model_name, unit.info)
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "adaserve",
                "max_model_len": info.max_model_len,
                # What the weights run as: "stored" (a GGUF's quantized blocks), "none", "int8".
                "quantization": info.quantization or "none",
                "slo": slo_info(info, router, name),
            }
            for name, info in sorted(seen.items())
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/slo")
    async def slo(request: Request) -> dict[str, Any]:
        """Per healthy unit: the baseline TPOT it measured (or was given), the TPOT
        each SLO class resolved to, the default class, and its SLO floor (the best TPOT
        one request alone can expect; SLOs below it are served best-effort); and per
        model, the TPOT each class is given across the fleet (`fleet`: the median of the
        units' values, router.fleet_slo)."""
        router: Router = request.app.state.gateway.router
        data = [
            {"model": u.info.served_model_name, "unit": u.address, **slo_info(u.info)}
            for u in sorted(router.healthy(), key=lambda u: u.address)
            if u.info
        ]
        fleet = [
            {"model": model, "classes": _fleet_classes(router, model)} for model in router.models()
        ]
        return {"object": "list", "data": data, "fleet": fleet}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"model": ErrorBody, "description": "no unit"}})
    async def ready(request: Request) -> JSONResponse:
        router: Router = request.app.state.gateway.router
        units = [
            {
                "address": u.address,
                "healthy": u.healthy and not u.retired,
                "outstanding": u.outstanding,
                "error": u.last_error or None,
                "draining": u.draining,
                "load": _load_summary(u),
            }
            for u in router.units.values()
        ]
        if router.healthy():
            return JSONResponse({"status": "ready", "units": units})
        err = APIError(503, "no healthy serving unit", code="no_healthy_unit")
        return JSONResponse({**err.body(), "units": units}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        gw.metrics.healthy_units.set(len(gw.router.healthy()))
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _load_summary(unit: Unit) -> dict[str, Any] | None:
    """The unit's last load report as /ready shows it (None: none yet)."""
    load = unit.load
    if load is None:
        return None
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": round(load.kv_usage, 4),
        "tightest_slo_ms": round(load.tightest_slo_ms, 3),
        "predicted_tpot_ms": round(load.tpot_ms(load.running + load.waiting + 1), 3),
        "age_s": round(time.monotonic() - unit.load_at, 3),
    }


def _fleet_classes(router: Router, model: str) -> dict[str, float]:
    """Each class's TPOT SLO (ms) across the fleet's units serving `model`."""
    out = {}
    for name in sorted(router.slo_classes()):
        fleet = router.fleet_slo(model, name)
        if fleet is not None:
            out[name] = round(fleet[1], 3)
    return out


def slo_info(
    info: vpb.InfoResponse, router: Router | None = None, model: str = ""
) -> dict[str, Any]:
    """A unit's SLO contract as /v1/slo and /v1/models show it; with `router`, each
    class's TPOT is the fleet's for `model` (what a request of the class is given)."""
    tpot = dict(info.slo_classes)
    if router is not None:
        tpot |= _fleet_classes(router, model)
    return {
        "baseline_tpot_ms": round(info.baseline_tpot_ms, 3),
        "default_class": info.default_slo_class,
        "classes": {
            name: {"tpot_ms": round(ms, 3)}
            | ({"ttft_ms": info.slo_class_ttft_ms[name]} if name in info.slo_class_ttft_ms else {})
            for name, ms in sorted(tpot.items())
            if name in info.slo_classes
        },
        "slo_floor_ms": round(info.slo_floor_ms, 3),
        "baseline": _baseline_info(info),
        "speculative": info.speculative,
        "speculation_methods": list(info.speculation_methods),
    }


def _baseline_info(info: vpb.InfoResponse) -> dict[str, Any]:
    """How the unit's baseline TPOT was set: configured, or measured (when, at what load,
    whether a busy host left it to be measured again)."""
    b = info.baseline
    if not info.HasField("baseline") or b.source == "configured":
        return {"source": "configured"}
    return {
        "source": b.source,
        "measured_at": round(b.measured_at, 3),
        "load_1m": round(b.load_1m, 2),
        "cores": b.cores,
        "settled": b.settled,
        "recalibrations": b.recalibrations,
    }


async def _unit_call(gw: Gateway, model: str | None, method: str, req: Any) -> Any:
    """A unary call to a healthy unit serving `model` (errors as OpenAI's)."""
    unit = gw.router.pick(model)
    try:
        return await getattr(unit.stub, method)(req, timeout=30.0)
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err, unit.address) from err


def _build(gw: Gateway, endpoint: str, make: Any) -> Any:
    try:
        return make()
    except APIError as err:
        gw.rejected(endpoint, err)
        raise


@dataclass(frozen=True)
class _Shape:
    """What the client asked the response to look like."""

    stream: bool
    include_usage: bool
    n: int  # choices per prompt returned (best_of may generate more and keep the best)
    logprobs: bool  # the client asked for logprobs


async def _serve(
    request: Request, gw: Gateway, built: list[specs.GenerateSpec], shape: _Shape
) -> Response:
    """One generation per prompt (completions take a list), each of spec.n sequences;
    choice i of prompt p is response choice p * n + i."""
    opened = await asyncio.gather(*(gw.open(spec) for spec in built), return_exceptions=True)
    gens = [g for g in opened if isinstance(g, Generation)]
    failed = [e for e in opened if isinstance(e, BaseException)]
    if failed:
        await asyncio.gather(*(g.aclose() for g in gens))
        raise failed[0]
    first = gens[0]
    assert first.header is not None
    spec = built[0]
    fmt = Formatter(
        spec.kind,
        spec.response_id,
        first.header.model,
        shape.include_usage,
        logprobs=shape.logprobs,
        tokens_as_ids=spec.tokens_as_ids,
        tools=spec.tools,
        tool_format=first.header.tool_call_format,
    )
    best_effort = any(g.header is not None and g.header.best_effort for g in gens)
    headers = {
        "x-request-id": spec.client_request_id or spec.engine_id,
        # Judged at admission, so known before the first token (and the status line).
        "x-slo-best-effort": "true" if best_effort else "false",
    }
    if shape.stream:
        headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return _SSEResponse(gens, _events(gens, fmt), headers=headers)
    try:
        body = await _until_disconnect(request, _collect(gens, fmt, shape.n))
    finally:
        await asyncio.gather(*(g.aclose() for g in gens))
    if body is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(body, headers=headers)


def _echo(gen: Generation) -> str | None:
    """The text to put before each of the generation's outputs (completions' echo)."""
    if not gen.spec.echo:
        return None
    if gen.spec.prompt_text is not None:
        return gen.spec.prompt_text
    return gen.header.prompt_text if gen.header else ""


def _echo_now(gen: Generation) -> str | None:
    """The echo sent before any chunk: all of it, unless the prompt's logprobs go with
    it (they come with the first chunk; the echo waits for them)."""
    return None if gen.spec.prompt_logprobs is not None else _echo(gen)


class _Choices:
    """Which generation each response choice belongs to, and what each choice still
    needs before its first chunk: the echo with the prompt's logprobs, vLLM's
    prompt_logprobs field; max_tokens 0 (echo only) hides the token generated."""

    def __init__(self, gens: list[Generation], fmt: Formatter) -> None:
        self.fmt = fmt
        self.owner = {p * g.spec.n + i: g for p, g in enumerate(gens) for i in range(g.spec.n)}
        self.started: set[int] = set()

    def chunk(self, index: int, c: Chunk) -> Chunk:
        gen = self.owner[index]
        if gen.spec.echo_only:
            c = replace(
                c,
                token_ids=(),
                text="",
                logprobs=None,
                num_generated=0,
                finish_reason=None if c.finish_reason is None else "length",
            )
        return c

    def first(self, index: int) -> tuple[Generation, str | None] | None:
        """The choice's generation and its deferred echo text, the first time only."""
        if index in self.started:
            return None
        self.started.add(index)
        gen = self.owner[index]
        fmt = self.fmt
        if gen.prompt is not None and gen.spec.prompt_logprobs_field is not None:
            fmt.set_prompt_logprobs(
                None if fmt.kind == "chat" else index, gen.prompt, gen.spec.prompt_logprobs_field
            )
        text = _echo(gen) if gen.spec.prompt_logprobs is not None else None
        return gen, text


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Chunk]]:
    """(response choice index, chunk) from every generation as they come."""
    if len(gens) == 1:
        async for c in gens[0].chunks():
            yield c.index, c
        return
    queue: asyncio.Queue[tuple[int, Chunk] | Exception | None] = asyncio.Queue()

    async def pump(p: int, gen: Generation) -> None:
        try:
            async for c in gen.chunks():
                queue.put_nowait((p * gen.spec.n + c.index, c))
            queue.put_nowait(None)
        except Exception as exc:  # handed to the reader, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(p, g)) for p, g in enumerate(gens)]
    left = len(gens)
    try:
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def _slo(gens: list[Generation]) -> dict[str, object]:
    summary = gens[0].slo_summary()
    summary["best_effort"] = any(g.best_effort for g in gens)
    return summary


async def _events(gens: list[Generation], fmt: Formatter) -> AsyncIterator[str]:
    prompt_tokens = sum(g.header.num_prompt_tokens for g in gens if g.header)
    done: dict[int, int] = {}  # choice -> its tokens, once finished
    total = sum(g.spec.n for g in gens)
    for p, gen in enumerate(gens):
        if (text := _echo_now(gen)) is not None:
            for i in range(gen.spec.n):
                yield sse(fmt.text_frame(p * gen.spec.n + i, text))
    book = _Choices(gens, fmt)
    try:
        async for index, raw in _merged(gens):
            chunk = book.chunk(index, raw)
            if (started := book.first(index)) is not None:
                gen, text = started
                if text is not None:  # the echo with the prompt's logprobs
                    k = gen.spec.logprobs or 0
                    yield sse(fmt.text_frame(index, text, gen.prompt, k))
            frame = fmt.chunk(chunk, index)
            if chunk.finish_reason is not None:
                done[index] = chunk.num_generated
            if frame is not None:
                if len(done) == total and chunk.finish_reason is not None:
                    frame["slo"] = _slo(gens)
                yield sse(frame)
    except APIError as err:
        # Headers are gone already: the error travels as a frame (the openai client
        # raises APIError on it) and there is no [DONE], so nothing looks complete.
        yield sse(err.body())
        return
    if fmt.include_usage:
        yield sse(fmt.usage_chunk(prompt_tokens, sum(done.values())))
    yield DONE_FRAME


async def _collect(gens: list[Generation], fmt: Formatter, n: int) -> dict[str, Any]:
    for p, gen in enumerate(gens):
        if (text := _echo_now(gen)) is not None:
            for i in range(gen.spec.n):
                fmt.prefix(p * gen.spec.n + i, text)
    book = _Choices(gens, fmt)
    async for index, raw in _merged(gens):
        chunk = book.chunk(index, raw)
        if (started := book.first(index)) is not None:
            gen, text = started
            if text is not None:  # the echo with the prompt's logprobs
                fmt.prefix(index, text, gen.prompt, gen.spec.logprobs or 0)
        fmt.add(chunk, index)
    prompt_tokens = sum(g.header.num_prompt_tokens for g in gens if g.header)
    choices = None
    if any(g.spec.n > n for g in gens):  # best_of: each prompt's n most likely sequences
        choices = []
        for p, gen in enumerate(gens):
            ids = [p * gen.spec.n + i for i in range(gen.spec.n)]
            ids.sort(key=lambda i: -fmt.choices[i].logprob_sum)
            for j, i in enumerate(ids[:n]):
                choices.append(fmt.body(i) | {"index": p * n + j})
    body = fmt.full(prompt_tokens, choices)
    body["slo"] = _slo(gens)
    return body


async def _until_disconnect(request: Request, coro: Any) -> Any:
    """Runs `coro` unless the client disconnects first (then cancels it, returns None).
    The body is already read, so the next ASGI message can only be the disconnect."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        return work.result() if work in done else None
    finally:
        for task in (work, watch):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


class _SSEResponse(StreamingResponse):
    """Streams until done or until the client disconnects, whichever comes first, and
    always closes the generations: a vanished client cancels the verifier calls at once
    rather than at the next write."""

    def __init__(self, gens: list[Generation], content: AsyncIterator[str], headers: dict) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._gens = gens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the socket closed under us
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await asyncio.gather(*(g.aclose() for g in self._gens))


def _openapi_without_422(app: FastAPI) -> None:
    """Validation errors are answered 400 (as OpenAI does), never FastAPI's 422: keep
    the published schema truthful."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        api = _validation_error(err)
        gw = getattr(request.app.state, "gateway", None)
        if gw is not None:
            endpoint = "chat" if request.url.path.endswith("chat/completions") else "completion"
            gw.rejected(endpoint, api)
        return JSONResponse(api.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        api = APIError(err.status_code, str(err.detail))
        return JSONResponse(api.body(), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": request.url.path})
        api = APIError(500, "internal server error", code="internal_error")
        return JSONResponse(api.body(), status_code=500)


def _validation_error(err: RequestValidationError) -> APIError:
    first = err.errors()[0] if err.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    whole_body = not [p for p in first.get("loc", ()) if p != "body"]
    if whole_body and first.get("type") not in ("value_error", "unsupported"):  # not an object
        return APIError(
            400,
            "request body must be a JSON object sent with Content-Type: application/json",
            code="invalid_body",
        )
    # An error on the whole body from our own checks is a cross-field one:
    # "logprobs is not supported", "presence_penalty and frequency_penalty ...".
    return from_validation(first, skip=("body",))
