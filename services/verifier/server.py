"""The verifier servicer: one serving unit's engine behind gRPC.

`Generate` turns the wire request into a `GenerationRequest` (tokenizing text, or
rendering chat messages with the target's chat template, off the event loop), submits
it, and relays the engine's `TokenDelta`s. When the call ends early for any reason
(client cancelled, gateway gone, deadline) the request is aborted, which frees its KV
on the verifier and the drafter.

Operating a fleet: `Load` streams this unit's load to each gateway (SLO-aware routing,
adaserve/routing.py); on SIGTERM `drain` stops admission (new requests get UNAVAILABLE,
which gateways retry on another unit), tells the gateways at once, and lets the
requests in flight finish for up to `fleet.drain_timeout_s`; a watchdog fails the
`liveness` health check (and readiness) while the engine loop makes no progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from adaserve.chat import tool_call_format
from adaserve.config import Settings
from adaserve.engine import Engine, EngineDraining, EngineFull
from adaserve.request import GenerationRequest, SamplingParams, TokenDelta
from adaserve.routing import PrefixLog
from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from adaserve.sampling import sequence_seed
from adaserve.slo import describe
from adaserve.stream import RequestStream
from services.common.convert import (
    load_to_pb,
    logprobs_to_pb,
    speculation_method_from_pb,
)
from services.common.server import GrpcServer, Service
from services.verifier.convert import (
    ResolvedSLO,
    baseline_to_pb,
    chunk_to_pb,
    render_chat,
    structured_output_from_pb,
)

log = logging.getLogger("adaserve.verifier")

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["Verifier"].full_name
CUSTOM_SLO_CLASS = "custom"
RETRY_AFTER_S = 1
# The health entry Kubernetes' liveness probe asks for (`grpc.service: liveness`): NOT_SERVING
# only while the engine loop is wedged, so a draining unit (readiness NOT_SERVING) is
# not restarted under its streams.
LIVENESS = "liveness"
MIN_REPORT_INTERVAL_S = 0.01


class VerifierServicer(vgrpc.VerifierServicer):
    def __init__(self, engine: Engine, settings: Settings, tokenizer: Any = None) -> None:
        self.engine = engine
        self.settings = settings
        # Its own tokenizer instance on its own thread: a fast tokenizer is not safe to
        # call from two threads at once ("Already borrowed"), and the engine thread
        # detokenizes with the engine's instance.
        self.tokenizer = tokenizer
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._pieces: dict[int, str] = {}  # token id -> its text alone (tokenizer thread)
        self._siblings: dict[str, list[str]] = {}  # request id -> its n engine ids
        self.prefixes = PrefixLog(settings.fleet.prefix_keys)
        self._generating = 0  # Generate calls past admission, not yet ended
        self._changed = asyncio.Event()  # replaced each time it fires (_notify)
        self._closed = False  # drained: Load streams end
        self._wedged = False

    async def Generate(
        self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vpb.GenerateChunk]:
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        prompt, sampling, prompt_text = await loop.run_in_executor(
            self._tokenize, self._convert, request
        )
        slo = self._slo(request)
        speculation = speculation_method_from_pb(request.speculation_method)
        n = max(1, request.n)
        # n > 1: n engine requests, each with its own SLO accounting and random stream;
        # the others are admitted once the first one's prompt is prefilled and take its
        # KV from the prefix cache (fork after prefill).
        ids = [request.request_id] + [f"{request.request_id}.{i}" for i in range(1, n)]
        reqs = [
            GenerationRequest(
                id=rid,
                prompt_token_ids=prompt,
                # The prompt is scored once, by sequence 0 (the others share its KV).
                sampling=replace(
                    sampling,
                    seed=sequence_seed(sampling.seed, i),
                    prompt_logprobs=sampling.prompt_logprobs if i == 0 else None,
                ),
                tpot_slo_ms=slo.tpot_ms,
                slo_class=slo.name,
                priority=request.priority,
                timeout_s=request.timeout_s or None,
                ttft_slo_ms=slo.ttft_ms,
                speculation=speculation,
                fork_of=None if i == 0 else ids[0],
            )
            for i, rid in enumerate(ids)
        ]
        streams: list[RequestStream] = []
        try:
            for r in reqs:
                streams.append(self.engine.submit(r))
        except EngineFull as exc:
            for s in streams:
                self.engine.abort(s.request_id)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                str(exc),
                trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),),
            )
        except EngineDraining as exc:
            for s in streams:
                self.engine.abort(s.request_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError:
            for s in streams:
                self.engine.abort(s.request_id)
            raise
        req, stream = reqs[0], streams[0]
        self._siblings[req.id] = ids
        self.prefixes.touch(request.prefix_keys)
        self._generating += 1
        log.info(
            "request admitted",
            extra={
                "request_id": req.id,
                "client_request_id": request.client_request_id or None,
                "prompt_tokens": len(prompt),
                "max_tokens": req.sampling.max_tokens,
                "n": n,
                "tpot_slo_ms": slo.tpot_ms,
                "slo_class": slo.name,
                "best_effort": stream.verdict.best_effort,
                "ttft_slo_ms": slo.ttft_ms,
            },
        )
        running = set(ids)
        # Prompt logprobs come with sequence 0's first chunk; the others' chunks wait
        # for it (they are admitted after its prefill, so this is a formality).
        held: list[tuple[int, TokenDelta]] | None = (
            [] if sampling.prompt_logprobs is not None and n > 1 else None
        )
        try:
            yield vpb.GenerateChunk(
                num_prompt_tokens=len(prompt),
                tpot_slo_ms=slo.tpot_ms,
                slo_class=slo.name,
                best_effort=stream.verdict.best_effort,
                slo_floor_ms=stream.verdict.floor_ms,
                best_effort_reason=stream.verdict.reason or "",
                ttft_slo_ms=slo.ttft_ms or 0.0,
                server_elapsed_ms=_ms_since(t0),
                prompt_text=prompt_text,
            )
            async for index, delta in _merged(streams):
                if held is not None:
                    if index != 0:
                        held.append((index, delta))
                        continue
                    ready, held = [(index, delta), *held], None
                else:
                    ready = [(index, delta)]
                for i, d in ready:
                    if d.finish_reason is not None:
                        running.discard(ids[i])
                    yield await self._chunk_pb(d, i, slo, t0, prompt)
        finally:
            self._generating -= 1
            self._siblings.pop(req.id, None)
            for rid in running:
                # Cancelled mid-stream (the exception propagates on its own).
                self.engine.abort(rid)

    async def _chunk_pb(
        self, delta: TokenDelta, index: int, slo: ResolvedSLO, t0: float, prompt: tuple[int, ...]
    ) -> vpb.GenerateChunk:
        loop = asyncio.get_running_loop()
        chunk = chunk_to_pb(delta, slo, _ms_since(t0))
        chunk.index = index
        if delta.logprobs is not None:
            lp = delta.logprobs
            wanted = {*delta.token_ids, *lp.top_ids.ravel().tolist()}
            pieces = await loop.run_in_executor(self._tokenize, self._decode_each, wanted)
            chunk.logprobs.CopyFrom(logprobs_to_pb(lp, pieces))
        if delta.prompt_logprobs is not None:
            plp = delta.prompt_logprobs
            wanted = {*prompt, *plp.top_ids.ravel().tolist()}
            pieces = await loop.run_in_executor(self._tokenize, self._decode_each, wanted)
            chunk.prompt_logprobs.CopyFrom(logprobs_to_pb(plp, pieces))
            chunk.prompt_token_ids.extend(prompt)
        return chunk

    async def Abort(
        self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vpb.AbortResponse:
        for rid in self._siblings.get(request.request_id, [request.request_id]):
            self.engine.abort(rid)
        return vpb.AbortResponse()

    async def Tokenize(
        self, request: vpb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> vpb.TokenizeResponse:
        loop = asyncio.get_running_loop()
        ids, pieces = await loop.run_in_executor(self._tokenize, self._tokenize_ids, request)
        return vpb.TokenizeResponse(ids=ids, max_model_len=self.engine.max_model_len, pieces=pieces)

    async def Detokenize(
        self, request: vpb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> vpb.DetokenizeResponse:
        vocab = int(getattr(self.engine.target, "vocab_size", 0))
        if any(t < 0 or t >= vocab for t in request.ids):
            raise ValueError(f"tokens: token ids must be in [0, {vocab})")
        tok = self._require_tokenizer()
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(
            self._tokenize, lambda: tok.decode(list(request.ids), skip_special_tokens=False)
        )
        return vpb.DetokenizeResponse(text=text)

    async def Info(
        self, request: vpb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.InfoResponse:
        info = self.engine.info()
        return vpb.InfoResponse(
            served_model_name=info.model,
            max_model_len=info.max_model_len,
            baseline_tpot_ms=info.baseline_tpot_ms,
            slo_classes=resolved_classes(self.settings, info.baseline_tpot_ms),
            default_slo_class=self.settings.slo.default_class,
            tp=self.settings.model.tp,
            speculative=info.speculative,
            vocab_size=int(getattr(self.engine.target, "vocab_size", 0)),
            eos_token_ids=list(info.eos_token_ids),
            slo_floor_ms=info.slo_floor_ms,
            slo_class_ttft_ms={
                name: cls.ttft_ms
                for name, cls in self.settings.slo.classes.items()
                if cls.ttft_ms is not None
            },
            speculation_methods=list(info.speculation_methods),
            tool_call_format=tool_call_format(self.tokenizer) if self.tokenizer else "",
            baseline=baseline_to_pb(info.baseline),
            quantization=info.quantization,
        )

    async def Stats(
        self, request: vpb.VerifierStatsRequest, context: grpc.aio.ServicerContext
    ) -> vpb.VerifierStatsResponse:
        s = self.engine.stats()
        return vpb.VerifierStatsResponse(
            running=s.running,
            waiting=s.waiting,
            kv_usage=s.kv_usage,
            num_requests=s.tracked,
            iterations=s.iterations,
            drafter_healthy=s.drafter_healthy,
            scheduler_healthy=s.scheduler_healthy,
        )

    async def Load(
        self, request: vpb.LoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vpb.LoadReport]:
        interval_ms = request.interval_ms or self.settings.fleet.report_interval_ms
        interval_s = max(interval_ms / 1000.0, MIN_REPORT_INTERVAL_S)
        cursor: int | None = None  # this reader's place in the prefix-key log
        while True:
            changed = self._changed
            report = load_to_pb(self.engine.load(), self.engine.loop_age_s())
            keys, reset, cursor = self.prefixes.since(cursor)
            report.prefix_keys.extend(keys)
            report.prefix_reset = reset
            report.prefix_capacity = self.prefixes.capacity
            yield report
            if self._closed:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), interval_s)

    # -- operating: drain and liveness -------------------------------------------------

    def _notify(self) -> None:
        """Every Load stream reports now (draining, closing)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def drain(self) -> None:
        """SIGTERM: take nothing new, report it at once, let what is in flight finish
        (up to fleet.drain_timeout_s), then end the Load streams so the server stops."""
        timeout_s = self.settings.fleet.drain_timeout_s
        self.engine.drain()
        self._notify()
        held = self.engine.stats().tracked
        log.info(
            f"draining: {held} request(s) in flight get up to {timeout_s:g} s to finish",
            extra={"requests": held, "drain_timeout_s": timeout_s},
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.engine.stats().tracked or self._generating:
            if loop.time() >= deadline:
                log.warning(
                    "drain timed out: ending the requests still in flight",
                    extra={"requests": self.engine.stats().tracked},
                )
                break
            await asyncio.sleep(0.05)
        else:
            log.info("drained: every request in flight finished")
        self._closed = True
        self._notify()

    async def start_watch(self, server: GrpcServer) -> None:
        """GrpcServer's on_start: the liveness watchdog runs beside the service."""
        server.spawn(self._watch_loop(server), "verifier-watch")

    async def _watch_loop(self, server: GrpcServer) -> None:
        """Liveness follows the engine loop: NOT_SERVING (liveness and readiness) while it
        has made no progress for fleet.liveness_timeout_s, SERVING again if it recovers.
        Also refreshes the load gauges (adaserve_slo_pressure, ...) every second."""
        timeout_s = self.settings.fleet.liveness_timeout_s
        period_s = min(1.0, timeout_s / 4)
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        while True:
            await asyncio.sleep(period_s)
            age = self.engine.loop_age_s()
            wedged = age > timeout_s
            if wedged and not self._wedged:
                log.error(
                    f"engine loop made no progress for {age:.1f} s: failing liveness",
                    extra={"loop_age_s": round(age, 1), "liveness_timeout_s": timeout_s},
                )
                await server.set_health(not_serving)
                await server.set_health(not_serving, [LIVENESS])
            elif self._wedged and not wedged:
                log.warning("engine loop progressing again: liveness restored")
                await server.set_health(serving, [LIVENESS])
                if not self.engine.draining:
                    await server.set_health(serving)
            self._wedged = wedged
            self.engine.load()

    # -- conversion ------------------------------------------------------------------

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this serving unit has no tokenizer: send prompt token ids")
        return self.tokenizer

    def _convert(self, request: vpb.GenerateRequest) -> tuple[tuple[int, ...], SamplingParams, str]:
        """(prompt ids, sampling, the prompt's text if echo was asked), on the
        tokenizer thread: bad words are tokenized and grammars compiled (refused here,
        naming the field, before anything is admitted)."""
        prompt = self._prompt_ids(request)
        sampling = self._sampling(request.sampling, len(prompt))
        so = sampling.structured
        if so is not None and self.engine.grammar is not None:
            self.engine.grammar.compile(so)
        text = ""
        if request.echo:
            text = self._require_tokenizer().decode(list(prompt), skip_special_tokens=False)
        return prompt, sampling, text

    def _decode_each(self, ids: set[int]) -> dict[int, str]:
        tok = self._require_tokenizer()
        for t in ids - self._pieces.keys():
            self._pieces[t] = tok.decode([t], skip_special_tokens=False)
        return {t: self._pieces[t] for t in ids}

    def _tokenize_ids(self, request: vpb.TokenizeRequest) -> tuple[list[int], list[str]]:
        tok = self._require_tokenizer()
        which = request.WhichOneof("prompt")
        if which == "text":
            ids = list(tok.encode(request.text, add_special_tokens=request.add_special_tokens))
        elif which == "chat":
            ids = render_chat(tok, request.chat)
        else:
            raise ValueError("prompt: one of text or messages is required")
        pieces = self._decode_each(set(ids))
        return ids, [pieces[t] for t in ids]

    def _prompt_ids(self, request: vpb.GenerateRequest) -> tuple[int, ...]:
        """Token ids of the prompt; ValueError (INVALID_ARGUMENT) when it cannot be had."""
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            return tuple(request.token_ids.ids)
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this serving unit has no tokenizer: send prompt token ids")
        if which == "text":
            return tuple(tok.encode(request.text))
        if which == "chat":
            return tuple(render_chat(tok, request.chat))
        raise ValueError("prompt: one of text, chat or token_ids is required")

    def _slo(self, request: vpb.GenerateRequest) -> ResolvedSLO:
        """The request's SLOs: explicit values win, then its class's (TTFT: only where
        the class sets one)."""
        slo = self.settings.slo
        ttft = request.ttft_slo_ms or None
        if request.tpot_slo_ms:
            cls = slo.classes.get(request.slo_class)
            if ttft is None and cls is not None:
                ttft = cls.ttft_ms
            return ResolvedSLO(request.tpot_slo_ms, ttft, request.slo_class or CUSTOM_SLO_CLASS)
        name = request.slo_class or slo.default_class
        if name not in slo.classes:
            known = ", ".join(sorted(slo.classes))
            raise ValueError(f"slo_class: unknown class {name!r}; known classes: {known}")
        cls = slo.classes[name]
        tpot = cls.resolve_ms(self.engine.info().baseline_tpot_ms)
        return ResolvedSLO(tpot, ttft if ttft is not None else cls.ttft_ms, name)

    def _sampling(self, sp: vpb.SamplingParams, num_prompt: int) -> SamplingParams:
        max_tokens = sp.max_tokens
        if max_tokens < 0:
            raise ValueError(
                f"max_tokens must be >= 0 (0: the rest of the context), got {max_tokens}"
            )
        if max_tokens == 0:
            max_tokens = self.engine.max_model_len - num_prompt
            if max_tokens < 1:
                raise ValueError(
                    f"prompt ({num_prompt} tokens) fills the model's context length "
                    f"({self.engine.max_model_len})"
                )
        return SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p or 1.0,
            top_k=sp.top_k,
            seed=sp.seed if sp.HasField("seed") else None,
            max_tokens=max_tokens,
            stop=tuple(sp.stop),
            stop_token_ids=tuple(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty or 1.0,
            logit_bias=tuple(sorted(sp.logit_bias.items())),
            min_p=sp.min_p,
            min_tokens=sp.min_tokens,
            bad_words=self._bad_words(sp.bad_words),
            allowed_token_ids=tuple(sp.allowed_token_ids),
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
            structured=structured_output_from_pb(sp.structured_output)
            if sp.HasField("structured_output")
            else None,
        )

    def _bad_words(self, words: Any) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad words: each word alone and after a space (where
        that is a different first token), so it is banned at the start and mid-text."""
        if not words:
            return ()
        tok = self._require_tokenizer()
        out: list[tuple[int, ...]] = []
        for word in words:
            if not word.strip():
                raise ValueError("bad_words: words must not be empty")
            plain = tuple(tok.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tok.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return tuple(out)


def resolved_classes(settings: Settings, baseline_tpot_ms: float) -> dict[str, float]:
    """Each SLO class's TPOT in milliseconds against this unit's baseline."""
    return {name: c.resolve_ms(baseline_tpot_ms) for name, c in settings.slo.classes.items()}


def log_slos(engine: Engine, settings: Settings) -> None:
    """Once at startup: the baseline this unit measured (or was given) and what each SLO
    class resolved to, which differ from machine to machine."""
    info = engine.info()
    classes = resolved_classes(settings, info.baseline_tpot_ms)
    default = settings.slo.default_class
    log.info(
        describe(info.baseline_tpot_ms, classes, default, info.slo_floor_ms),
        extra={
            "baseline_tpot_ms": round(info.baseline_tpot_ms, 2),
            "slo_classes_ms": {k: round(v, 2) for k, v in classes.items()},
            "default_slo_class": default,
            "slo_floor_ms": round(info.slo_floor_ms, 2),
        },
    )


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, TokenDelta]]:
    """(sequence index, delta) from n streams as they come, until every one finished."""
    if len(streams) == 1:
        async for delta in streams[0].aiter():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TokenDelta]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        async for delta in s.aiter():
            queue.put_nowait((i, delta))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    left = len(streams)
    try:
        while left:
            i, delta = await queue.get()
            left -= delta.finish_reason is not None
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()


def _ms_since(t0: float) -> float:
    return (time.monotonic() - t0) * 1000.0


def build_server(
    engine: Engine, settings: Settings, host: str, port: int, tokenizer: Any = None
) -> GrpcServer:
    servicer = VerifierServicer(engine, settings, tokenizer)
    return GrpcServer(
        [Service(SERVICE_NAME, lambda s: vgrpc.add_VerifierServicer_to_server(servicer, s))],
        host,
        port,
        # What the drain left running is cut after this (it already had its time).
        grace_s=1.0,
        on_start=servicer.start_watch,
        drain=servicer.drain,
        extra_health=[LIVENESS],
    )
