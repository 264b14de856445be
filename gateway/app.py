"""The OpenAI-compatible REST front (FastAPI).

`create_app` builds a self-contained app: its lifespan starts the verifier router
(health checks) and, when a gRPC port is given, the gRPC front on the same event loop.
Every error the client sees is OpenAI-shaped (`gateway.errors`); bad input is 400,
never 500.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve.config import Settings
from adaserve.rpc.v1 import verifier_pb2 as vpb
from gateway import spec as specs
from gateway.auth import ApiKeys
from gateway.core import Gateway
from gateway.errors import APIError, from_grpc, from_validation, model_not_found
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics
from gateway.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorBody,
    TokenizeRequest,
)
from gateway.router import Router, Unit
from gateway.spec import check_unknown
from gateway.streaming import Shape, serve

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
        shape = Shape(body.stream, body.include_usage, body.n, body.logprobs is not None)
        return await serve(request, gw, built, shape)

    @app.post("/v1/chat/completions", responses=errors | generated)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        spec = _build(
            gw, "chat", lambda: specs.from_chat(body, settings, request.headers, gw.slo_classes())
        )
        shape = Shape(body.stream, body.include_usage, body.n, body.logprobs)
        return await serve(request, gw, [spec], shape)

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
        return {"object": "list", "data": model_cards(request.app.state.gateway.router)}

    @app.get("/v1/models/{model:path}", responses=errors)
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        """OpenAI's model retrieval (`client.models.retrieve`): the model's entry of
        /v1/models, or 404 `model_not_found` where no healthy unit serves it."""
        for card in model_cards(request.app.state.gateway.router):
            if card["id"] == model:
                return card
        raise model_not_found(model)

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


def model_cards(router: Router) -> list[dict[str, Any]]:
    """/v1/models' entries: each model a healthy unit serves, described by the first of
    its units by address."""
    seen: dict[str, vpb.InfoResponse] = {}
    for unit in sorted(router.healthy(), key=lambda u: u.address):
        if unit.info:
            seen.setdefault(unit.info.served_model_name, unit.info)
    return [
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
