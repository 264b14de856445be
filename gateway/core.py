"""The gateway's one domain operation: forward a request to a verifier unit and relay
its stream. Both fronts (REST and gRPC) call `Gateway.open`, then iterate
`Generation.chunks()`, then `aclose()`; routing, retries before admission, metrics and
the per-request log line live here so the fronts only translate formats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import grpc

from adaserve.config import Settings
from adaserve.request import TokenLogprobs
from gateway.errors import APIError, from_grpc
from gateway.metrics import GatewayMetrics, RequestTimes
from gateway.router import Router, Unit
from gateway.spec import GenerateSpec
from services.common.convert import WireError, finish_reason_from_pb, logprobs_from_pb

log = logging.getLogger("adaserve.gateway.requests")

CLIENT_CLOSED = 499  # nginx's status for "client went away first"
# Backstop over the engine's own timeout_s handling, which normally fires first.
_DEADLINE_SLACK_S = 5.0


@dataclass(frozen=True)
class Header:
    """The verifier admitted the request: what is known before any token."""

    model: str
    num_prompt_tokens: int
    tpot_slo_ms: float
    slo_class: str
    best_effort: bool = False  # the SLO is below the unit's floor (judged at admission)
    slo_floor_ms: float | None = None  # None: a unit that does not report it
    best_effort_reason: str | None = None
    ttft_slo_ms: float | None = None
    prompt_text: str = ""  # the prompt decoded by the unit, when echo was asked
    tool_call_format: str = "hermes"  # how the unit's model writes tool calls


@dataclass(frozen=True)
class PromptScores:
    """The prompt's log-probabilities (prompt_logprobs, echo with logprobs): entry i of
    `logprobs` scores `ids[i + 1]` (the first prompt token has none)."""

    ids: tuple[int, ...]
    logprobs: TokenLogprobs  # ranks set
    pieces: dict[int, str]  # the text of every id (prompt and top ids), alone


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None  # "stop" | "length" on its sequence's last chunk
    num_prompt_tokens: int
    num_generated: int  # of this chunk's sequence, so far
    index: int = 0  # which of the request's n sequences
    logprobs: TokenLogprobs | None = None  # of token_ids, when asked for
    pieces: dict[int, str] | None = None  # the text of every token id in logprobs
    prompt: PromptScores | None = None  # sequence 0's first chunk, when asked for


class Gateway:
    def __init__(self, settings: Settings, router: Router, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.router = router
        self.metrics = metrics

    def slo_classes(self) -> set[str]:
        return set(self.settings.slo.classes) | self.router.slo_classes()

    def rejected(self, endpoint: str, err: APIError, slo_class: str = "") -> None:
        """Count a request refused before it reached a unit (validation, auth)."""
        self.metrics.requests.labels(endpoint, str(err.status), slo_class).inc()

    async def open(self, spec: GenerateSpec) -> Generation:
        """Route and submit; returns once the unit admitted the request. Raises
        APIError (400 bad input, 429 engine full, 503 no unit) before any output."""
        if spec.tpot_slo_ms is None:  # a class: the same TPOT whichever unit serves it
            fleet = self.router.fleet_slo(spec.model, spec.slo_class)
            if fleet is not None:
                spec = replace(spec, slo_class=fleet[0], tpot_slo_ms=fleet[1])
        gen = Generation(self, spec)
        self.metrics.in_flight.inc()
        tried: set[str] = set()
        refused: APIError | None = None
        try:
            while True:
                try:
                    unit = self.router.pick(
                        spec.model,
                        frozenset(tried),
                        spec.route_request(),
                        spec.tpot_slo_ms,
                        spec.slo_class,
                    )
                except APIError as err:
                    # Every unit tried: a full one's 429 says more than "none left".
                    raise (refused if refused is not None and tried else err) from None
                tried.add(unit.address)
                try:
                    await gen.submit(unit)
                    return gen
                except _Retry as retry:  # gone or full before admitting: try another
                    refused = retry.error if retry.error.status == 429 else refused
        except APIError as err:
            gen.status = err.status
            await gen.aclose()
            raise
        except BaseException:  # cancelled while waiting for admission: client gone
            await gen.aclose()
            raise


class _Retry(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class Generation:
    """One request in flight. Always `aclose()` it (the fronts do, in `finally`)."""

    def __init__(self, gateway: Gateway, spec: GenerateSpec) -> None:
        self.gw = gateway
        self.spec = spec
        self.times = RequestTimes(time.monotonic())
        self.header: Header | None = None
        self.status: int | None = None  # HTTP status once known
        self.finish_reason: str | None = None
        self.best_effort = False
        self.unit: Unit | None = None  # the unit serving (or last tried)
        self._leased: Unit | None = None  # counted in its outstanding requests
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._text: list[str] = []  # only kept when settings.log_prompts
        # The prompt's logprobs once they came (spec.prompt_logprobs), for every choice.
        self.prompt: PromptScores | None = None
        self._closed = False

    async def submit(self, unit: Unit) -> None:
        spec = self.spec
        deadline = None if spec.timeout_s is None else spec.timeout_s + _DEADLINE_SLACK_S
        self.unit = self._leased = unit
        unit.outstanding += 1
        self._call = unit.stub.Generate(spec.to_pb(), timeout=deadline)
        try:
            first = await self._call.read()
        except grpc.aio.AioRpcError as err:
            self._release()
            api = from_grpc(err, unit.address)
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.gw.router.mark_failed(unit, f"Generate: {err.details()}")
                raise _Retry(api) from err
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise _Retry(api) from err
            raise api from err
        if first is grpc.aio.EOF:
            self._release()
            raise APIError(502, f"serving unit {unit.address} closed the stream before admission")
        self.header = Header(
            model=unit.info.served_model_name if unit.info else (spec.model or ""),
            num_prompt_tokens=first.num_prompt_tokens,
            tpot_slo_ms=first.tpot_slo_ms,
            slo_class=first.slo_class or spec.metrics_class,
            best_effort=first.best_effort,
            slo_floor_ms=first.slo_floor_ms or None,
            best_effort_reason=first.best_effort_reason or None,
            ttft_slo_ms=first.ttft_slo_ms or None,
            prompt_text=first.prompt_text,
            tool_call_format=(unit.info.tool_call_format if unit.info else "") or "hermes",
        )
        self.best_effort = first.best_effort

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Token chunks in order, each sequence's last with its finish_reason (OpenAI's
        only: "stop" or "length"); ends once all n sequences have finished. Raises
        APIError when the unit fails mid-stream, and when a sequence timed out or was
        aborted: OpenAI clients know no such finish reason, so the fronts turn it into
        an error (a status, or an error frame once streaming)."""
        assert self._call is not None and self.unit is not None
        left = set(range(self.spec.n))
        while True:
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    self.gw.router.mark_failed(self.unit, f"Generate: {err.details()}")
                self.status = 503 if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED else 408
                raise from_grpc(err, self.unit.address) from err
            if msg is grpc.aio.EOF:
                self.status = 502
                raise APIError(502, "serving unit ended the stream without a finish reason")
            reason = finish_reason_from_pb(msg.finish_reason)
            if reason == "error":
                self.status = 500
                raise APIError(500, f"generation failed: {msg.error or 'engine error'}")
            if reason == "timeout":
                self.status = 408
                raise APIError(
                    408,
                    f"request timed out after {self.spec.timeout_s:g} s (timeout)",
                    param="timeout",
                    code="timeout",
                )
            if reason == "abort":
                self.status = 503
                raise APIError(503, "the serving unit aborted the request", code="aborted")
            if msg.index == 0:  # one sequence's pace: the SLO is per sequence
                self.times.on_tokens(time.monotonic(), len(msg.token_ids))
            # Judged at submit and carried by the header; chunks repeat it.
            self.best_effort |= msg.best_effort
            if self.gw.settings.log_prompts:
                self._text.append(msg.text)
            logprobs, pieces = None, None
            if msg.HasField("logprobs"):
                try:
                    logprobs = logprobs_from_pb(msg.logprobs, len(msg.token_ids))
                except WireError as exc:
                    self.status = 502
                    raise APIError(502, f"serving unit sent bad logprobs: {exc}") from exc
                pieces = dict(msg.logprobs.pieces)
            if msg.HasField("prompt_logprobs"):
                self.prompt = self._prompt_scores(msg)
            elif self.spec.prompt_logprobs is not None and self.prompt is None:
                self.status = 502
                raise APIError(502, "serving unit sent no prompt logprobs")
            yield Chunk(
                tuple(msg.token_ids),
                msg.text,
                reason,
                msg.num_prompt_tokens,
                msg.num_generated,
                msg.index,
                logprobs,
                pieces,
                self.prompt,
            )
            if reason is not None:
                left.discard(msg.index)
                self.finish_reason = reason
                if not left:
                    self.status = 200
                    return

    def _prompt_scores(self, msg: Any) -> PromptScores:
        ids = tuple(msg.prompt_token_ids)
        try:
            if len(ids) != msg.num_prompt_tokens:
                raise WireError(f"{len(ids)} prompt_token_ids for {msg.num_prompt_tokens} tokens")
            lp = logprobs_from_pb(msg.prompt_logprobs, max(len(ids) - 1, 0), "prompt_logprobs")
            if lp.ranks is None and ids[1:]:
                raise WireError("prompt_logprobs: no ranks")
        except WireError as exc:
            self.status = 502
            raise APIError(502, f"serving unit sent bad prompt logprobs: {exc}") from exc
        return PromptScores(ids, lp, dict(msg.prompt_logprobs.pieces))

    def slo_summary(self) -> dict[str, object]:
        """adaserve's extra response field: the SLO the request ran under, whether it
        was served best-effort and why, and the unit's floor (the best TPOT one request
        alone can expect there). OpenAI clients ignore unknown fields."""
        h = self.header
        return {
            # Rounded like every other SLO figure: 1.2 x 371.4 is 445.68, not ...67999.
            "tpot_slo_ms": _round(h.tpot_slo_ms) if h else None,
            "ttft_slo_ms": _round(h.ttft_slo_ms) if h else None,
            "slo_class": h.slo_class if h else None,
            "best_effort": self.best_effort,
            "slo_floor_ms": _round(h.slo_floor_ms) if h else None,
            "reason": h.best_effort_reason if h else None,
        }

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._call is not None and not self._call.done():
            self._call.cancel()  # the verifier aborts the request and frees its KV
        self._release()
        self.gw.metrics.in_flight.dec()
        status = self.status if self.status is not None else CLIENT_CLOSED
        now = time.monotonic()
        h = self.header
        slo_class = h.slo_class if h else self.spec.metrics_class
        self.gw.metrics.requests.labels(self.spec.kind, str(status), slo_class).inc()
        if h is not None and self.finish_reason in ("stop", "length"):
            self.gw.metrics.finished(
                slo_class,
                h.tpot_slo_ms,
                self.times,
                now,
                h.num_prompt_tokens,
                self.best_effort,
                ttft_slo_ms=h.ttft_slo_ms,
            )
        self._log(status, now)

    def _release(self) -> None:
        if self._leased is not None:
            self._leased.outstanding -= 1
            self._leased = None

    def _log(self, status: int, now: float) -> None:
        t, h = self.times, self.header
        fields = {
            "request_id": self.spec.engine_id,
            "client_request_id": self.spec.client_request_id,
            "endpoint": self.spec.kind,
            "status": status,
            "finish_reason": self.finish_reason,
            "unit": self.unit.address if self.unit else None,
            "slo_class": h.slo_class if h else self.spec.metrics_class,
            "tpot_slo_ms": _round(h.tpot_slo_ms if h else self.spec.tpot_slo_ms),
            "ttft_slo_ms": _round(h.ttft_slo_ms if h else self.spec.ttft_slo_ms),
            "prompt_tokens": h.num_prompt_tokens if h else None,
            "completion_tokens": t.n_tokens,
            "ttft_ms": _ms(t.t_first - t.t_submit) if t.t_first is not None else None,
            "tpot_ms": _ms(t.tpot_s) if t.tpot_s is not None else None,
            "e2e_ms": _ms(now - t.t_submit),
        }
        if self.gw.settings.log_prompts:
            fields["prompt"] = self.spec.prompt_text or [
                m.content for m in self.spec.messages or ()
            ]
            fields["completion"] = "".join(self._text)
        log.info("request finished", extra=fields)


def _round(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
