"""The serving engine: request pool, admission, and the iteration loop.

One thread owns all request state; other threads talk to it through `submit`/`abort`
(queues) and read results from `RequestStream`s. Each iteration is one target forward
and reads like the papers:

    intake -> form the batch (trees + prefill chunks) -> speculate -> select
           -> one forward -> apply (stream, retire)

Batch formation (adaserve/batching.py) splits the iteration's tokens in SLO order:
the tree tokens that keep decoding requests on their TPOT SLO, prefill chunks by TTFT
deadline, then throughput. The drafter, the scheduler and the target are interfaces:
in-process or gRPC, real or modelled (the simulator runs this same code). The drafter
and the scheduler are wrapped once at start-up (adaserve/fallback.py), so a failing
drafter degrades to plain decoding and a failing scheduler to in-process selection
without a branch in the step. Beside the draft model, an n-gram drafter (adaserve/
ngram.py) may draft from the request's own tokens; which of them drafts each request
each iteration is its speculation method's choice (adaserve/methods.py).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from adaserve import cpu_load, metrics
from adaserve.adaptive import (
    AcceptanceEstimate,
    SLOFloor,
    ngram_pays,
    plan_depth_width,
    slack_plan,
    slo_floor,
)
from adaserve.batching import (
    BatchLimits,
    BatchPlan,
    Decoding,
    Prefilling,
    behind_tpot,
    form_batch,
    hold_prompt,
    slo_tree_budget,
)
from adaserve.calibration import Baseline, Remeasure, RetrySchedule, remeasured
from adaserve.config import AdaptiveSettings, Settings
from adaserve.detokenize import IncrementalDetokenizer, Tokenizer
from adaserve.fallback import FallbackDrafter, FallbackScheduler
from adaserve.features import FeatureRows
from adaserve.grammar import Constraint, GrammarBackend
from adaserve.isolation import Quarantine, report
from adaserve.latency import Curve, ForwardLatency
from adaserve.logits_process import LogitsContext
from adaserve.methods import (
    SOURCES,
    USES_EAGLE,
    USES_MODEL,
    USES_NGRAM,
    SourceStats,
    available_methods,
    chain_tokens,
    check_available,
    choose_source,
    drafter_source,
    expected_tokens,
    resolve_method,
    scale_f,
    uses_drafter,
)
from adaserve.request import GenerationRequest, TokenDelta, TokenLogprobs
from adaserve.routing import UnitLoad
from adaserve.sampling import TokenRng
from adaserve.scheduler import LocalScheduler, Scheduler, selection_params
from adaserve.selection import RequestProgress, Selection, SelectionParams
from adaserve.slo import SLOVerdict, judge, required_accepted
from adaserve.speculate import Drafter, DraftUpdate
from adaserve.stream import RequestStream
from adaserve.target import PrefillChunk, TargetModel, VerifyItem
from adaserve.tree import CandidateTree, merge_trees

__all__ = [
    "Engine",
    "EngineDraining",
    "EngineFull",
    "EngineInfo",
    "EngineStats",
    "RequestStream",
    "SLOUnattainable",
]

log = logging.getLogger("adaserve.engine")

# A request without a TTFT SLO is prefilled as if its deadline were this far after its
# arrival: finite, so earliest-deadline order serves it eventually, and late enough that
# requests with a TTFT SLO go first.
UNSET_TTFT_ORDER_MS = 10_000.0
# The reported SLO floor moves only when the computed one moves by more than this share
# (Engine.slo_floor): iteration times jitter by a few percent from step to step.
FLOOR_HYSTERESIS = 0.1


class EngineFull(RuntimeError):
    """The waiting queue is full: callers answer 429 / RESOURCE_EXHAUSTED."""


class EngineDraining(RuntimeError):
    """The unit is draining (SIGTERM): it finishes what it holds and takes nothing new;
    callers answer UNAVAILABLE, which routers take as "try another unit"."""


class SLOUnattainable(ValueError):
    """The SLO is below what this deployment can ever reach and the policy
    (`engine.unattainable_slo: reject`) refuses such requests (400 / INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class EngineInfo:
    model: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    baseline_tpot_ms: float
    speculative: bool
    slo_floor_ms: float  # the best TPOT one request alone can expect (Engine.slo_floor)
    speculation_methods: tuple[str, ...] = ("auto", "none")  # what requests may ask for
    baseline: Baseline | None = None  # how baseline_tpot_ms was set or measured
    quantization: str = "none"  # what the target's weights run as (model.quantization)


@dataclass(frozen=True)
class EngineStats:
    running: int  # admitted: decoding or being prefilled
    waiting: int
    tracked: int  # requests holding any engine state (running + waiting + finishing)
    kv_usage: float
    iterations: int
    drafter_healthy: bool
    scheduler_healthy: bool
    prefilling: int = 0  # admitted requests whose prompt is not all prefilled yet


@dataclass
class _Request:
    """Engine-side mutable state of one request; touched only by the loop thread."""

    req: GenerationRequest
    stream: RequestStream
    arrival: float
    tokens: list[int]  # prompt + generated, all committed
    detok: IncrementalDetokenizer | None
    generator: TokenRng | None
    ttft_deadline: float  # engine clock; the prefill order (earliest first)
    best_effort: bool = False
    first_token_t: float | None = None
    last_token_t: float | None = None
    prefilled: int = 0  # tokens whose KV the target holds (prefix-cache hits included)
    # Tokens to hold before decoding: the prompt; after a preemption every token but the
    # last, which roots the next tree again (recompute, not swap).
    prefill_target: int = 0
    drafter_len: int = 0  # tokens the drafter holds as committed
    # Policy adaserve, `scheduler.draft_relaxed` off: the request's TPOT so far is above
    # its SLO (batching.behind_tpot), so it is drafted for even if relaxed.
    needs_drafts: bool = False
    # Admitted while other prompts with a TTFT SLO waited, with a TPOT SLO plain
    # decoding meets (Engine._relaxed): not drafted for unless behind (needs_drafts).
    plain: bool = False
    ngram_len: int = 0  # tokens the n-gram drafter holds
    method: str = "auto"  # speculation method asked for (adaserve/methods.py)
    source: str = "none"  # what drafted this iteration's tree (methods.SOURCES)
    finished: bool = False
    constraint: Constraint | None = None  # structured output: the grammar's matcher
    prompt_ids: np.ndarray | None = None  # int32 [P], for the logits processors
    # Tokens that end the output (eos unless ignore_eos, stop_token_ids): min_tokens
    # holds them back, the grammar never consumes them.
    stop_ids: tuple[int, ...] = ()
    # prompt_logprobs: what the prefill chunks scored so far (prompt tokens 1, 2, ...)
    prompt_lp: list[TokenLogprobs] = field(default_factory=list)
    # The target's features an EAGLE drafter still needs (adaserve/features.py); None
    # where the unit has none or the request's method never uses it.
    feats: FeatureRows | None = None

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_target

    @property
    def scores_prompt(self) -> bool:
        """Its prefill still owes the prompt's logprobs (sent with the first token): the
        prompt is computed in full, never taken from the prefix cache."""
        return self.req.sampling.prompt_logprobs is not None and self.num_generated == 0

    @property
    def deadline(self) -> float | None:
        t = self.req.timeout_s
        return None if t is None else self.arrival + t


# Decayed verifications of n-gram trees (SourceStats.steps) from which `auto` judges
# them by what they measured rather than by their prior acceptance.
NGRAM_EVIDENCE_STEPS = 5.0


@dataclass
class _TSpecPredictor:
    """Predicts a decode iteration's latency (drafting included) from its tree tokens:
    an EWMA of measured iterations per token count, seeded from the profile and
    inflated by the correction factor."""

    initial_ms: float
    correction: float
    alpha: float = 0.3
    _ewma: dict[int, float] = field(default_factory=dict)

    def predict_ms(self, num_tokens: int) -> float:
        return self.measured_ms(num_tokens) * self.correction

    def measured_ms(self, num_tokens: int) -> float:
        """The EWMA itself, before the correction factor (selection_params applies it)."""
        return self._ewma.get(_bucket(num_tokens), self.initial_ms)

    def observe(self, num_tokens: int, ms: float) -> None:
        bucket = _bucket(num_tokens)
        prev = self._ewma.get(bucket, ms)
        self._ewma[bucket] = (1 - self.alpha) * prev + self.alpha * ms


def _bucket(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


# What other threads hand the loop: a submission (with its arrival time) or an abort.
_InboxItem = (
    tuple[Literal["submit"], tuple[GenerationRequest, RequestStream, float]]
    | tuple[Literal["abort"], str]
)


@dataclass(frozen=True)
class _Step:
    """What one iteration runs, decided before the drafter is asked."""

    decoding: list[_Request]
    drafted: list[_Request]  # the decoding requests to draft for
    depth: int
    width: int
    chunks: list[tuple[_Request, PrefillChunk]]
    batch: BatchPlan

    @property
    def carried(self) -> list[_Request]:
        """The requests the forward carries: the trees' and the chunks'."""
        return [*self.decoding, *(r for r, _ in self.chunks)]


def _alive(step: _Step, selected: list[CandidateTree]) -> tuple[_Step, list[CandidateTree]]:
    """The step without the requests that ended during it (their own work failed)."""
    keep = [i for i, r in enumerate(step.decoding) if not r.finished]
    if len(keep) == len(step.decoding) and not any(r.finished for r, _ in step.chunks):
        return step, selected
    return replace(
        step,
        decoding=[step.decoding[i] for i in keep],
        drafted=[r for r in step.drafted if not r.finished],
        chunks=[(r, c) for r, c in step.chunks if not r.finished],
    ), [selected[i] for i in keep]


class Engine:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None,
        scheduler: Scheduler,
        settings: Settings,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
        model_name: str = "adaserve",
        latency: ForwardLatency | None = None,
        ngram: Drafter | None = None,
        baseline: Baseline | None = None,
        remeasure: Remeasure | None = None,
        quantization: str = "none",
    ) -> None:
        if settings.slo.baseline_tpot_ms == "auto":
            raise ValueError(
                "slo.baseline_tpot_ms 'auto' must be measured first (build_engine does)"
            )
        # `baseline`: how build_engine measured it; `remeasure`: how to time it again
        # while it is unsettled (adaserve/calibration.py).
        self.baseline = baseline or Baseline.configured(settings.slo.baseline_tpot_ms)
        self._remeasure = remeasure
        self._retry = RetrySchedule()
        metrics.baseline_tpot_seconds.set(self.baseline.tpot_ms / 1000.0)
        self.target = target
        self.settings = settings
        self.tokenizer = tokenizer
        # Structured output needs the tokenizer (the grammar is over text); its
        # llguidance tokenizer is built on the first request that uses it.
        self.grammar = (
            GrammarBackend(tokenizer, target.vocab_size, target.eos_token_ids)
            if tokenizer is not None
            else None
        )
        self.clock = clock
        self.model_name = model_name
        self.quantization = quantization
        self.local_scheduler = LocalScheduler(settings.scheduler)
        self.scheduler = FallbackScheduler(scheduler, self.local_scheduler)
        self.drafter: FallbackDrafter | None = None
        if drafter is not None and settings.engine.speculation:
            self.drafter = FallbackDrafter(
                drafter, self._history, target.vocab_size, clock=lambda: self.clock()
            )
        self.ngram: FallbackDrafter | None = None
        if ngram is not None and settings.engine.speculation:
            self.ngram = FallbackDrafter(
                ngram, self._history, target.vocab_size, clock=lambda: self.clock()
            )
        # The unit's drafter is a draft model or an EAGLE head (its `kind`): the head
        # reads the target's features, which the target then returns (adaserve/
        # features.py), and the requests whose method may use it keep them.
        self.drafter_kind = str(getattr(drafter, "kind", "model"))
        self._uses_drafter = USES_EAGLE if self.drafter_kind == "eagle" else USES_MODEL
        eagle = self.drafter is not None and self.drafter_kind == "eagle"
        self._feature_dim = 0
        if eagle:
            spec = drafter.spec  # type: ignore[union-attr]
            target.return_features(  # type: ignore[attr-defined]
                spec.feature_layers, spec.target_layers, spec.hidden_size
            )
            self._feature_dim = int(spec.feature_dim)
        self._recompute: set[str] = set()  # requests whose features the target recomputes
        self.methods = available_methods(
            self.drafter is not None and not eagle, self.ngram is not None, eagle
        )
        # A default or an SLO class naming eagle on a unit without an EAGLE drafter
        # would refuse every request it covers: refused here, at startup, instead
        # (the other methods keep their per-request answer).
        configured = {"speculation.default_method": settings.speculation.default_method}
        for name, cls in settings.slo.classes.items():
            if cls.speculation is not None:
                configured[f"slo.classes.{name}.speculation"] = cls.speculation
        for field_name, method in configured.items():
            if method == "eagle" and method not in self.methods:
                raise ValueError(
                    f"{field_name} {method!r} is not available on this unit "
                    f"(available: {', '.join(self.methods)})"
                )
        self.method_stats = {source: SourceStats() for source in SOURCES}
        # Per level, where it proposes: whether verifying its trees pays under load.
        self.ngram_acceptance = AcceptanceEstimate(settings.speculation.ngram.acceptance)
        adaptive = settings.scheduler.adaptive
        self.acceptance = (
            AcceptanceEstimate(adaptive.acceptance) if adaptive.learn_acceptance else None
        )
        # The longest sequence the KV cache can hold beside one tree of scratch: a
        # request is never admitted that could not run alone.
        adaptive = settings.scheduler.adaptive
        scratch = 1 + adaptive.d_max * adaptive.w_max if self.drafter is not None else 1
        ng = settings.speculation.ngram
        if self.ngram is not None:  # a merged tree holds both drafters' nodes
            scratch += ng.depth * ng.width
        self.kv_tokens = target.num_blocks * target.block_size
        self.max_model_len = min(
            target.max_model_len,
            settings.engine.max_model_len or target.max_model_len,
            self.kv_tokens - scratch,
        )
        base_ms = self.baseline_tpot_ms
        self.tspec = _TSpecPredictor(base_ms, settings.scheduler.correction_factor)
        if latency is None:
            curve = settings.engine.latency_curve
            latency = ForwardLatency(
                Curve(tuple(curve.tokens), tuple(curve.ms), curve.context_ms)
                if curve is not None
                else Curve.knee(base_ms, settings.scheduler.budget)
            )
        self.latency = latency
        self._draft_ms = 0.0  # EWMA of a drafting iteration's speculate phase
        self._model_draft_ms = 0.0  # EWMA of the model drafter's call where it drafted
        # EWMA of the n-gram drafter's host time per request where it drafted: its
        # lookups plus the selection over the trees (what `_ngram_pays` weighs).
        self._ngram_host_ms = 0.0
        self._ngram_lookup_ms = 0.0  # this iteration's lookups
        # EWMA of the drafter's time per prompt token it ingests beside the target's
        # prefill: part of what a prefill token costs the iteration.
        self._ingest_ms = 0.0
        # The last iteration's prompts needed more prefill than it carried (BatchPlan):
        # the prompt hold then admits (a held prompt would join a late queue).
        self._ttft_short = False
        # What decoding requests actually waited per token lately (iteration time, prefill
        # chunks and drafting included, over tokens emitted per request) and at what
        # batch size: calibrates the modelled TPOT curve routers read (load()).
        self._tpot_seen: tuple[float, float] | None = None  # (EWMA ms, EWMA batch)

        self._floor: SLOFloor | None = None  # the floor every report reads (slo_floor)
        self._inbox: queue.SimpleQueue[_InboxItem] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._iterations = 0
        self._arrivals = itertools.count()
        # Ids of submitted, not yet retired requests: a second request under a live id
        # would share the first one's KV sequence and fail the whole batch.
        self._live_ids: set[str] = set()
        self._live_lock = threading.Lock()
        self._optimal_invalid_logged = False
        self.preemptions = 0  # requests preempted so far (the metric counts them too)
        # (TTFT deadline s, prompt tokens left) of every prompt waiting for or in prefill,
        # republished by the loop thread each step: submit reads it to judge a TTFT SLO.
        self._prefill_queue: tuple[tuple[float, int], ...] = ()
        self._thread: threading.Thread | None = None
        self._loop_done: Future | None = None
        self._stop = threading.Event()
        self._draining = False
        # The loop stamps this every pass (idle or not): its age is how long the loop
        # has made no progress, which liveness checks read (a wedged forward).
        self._beat: float | None = None
        # Failure isolation (adaserve/isolation.py): the suspects of failed iterations,
        # and the requests the iteration in progress carries (None: not decided yet).
        self._quarantine = Quarantine()
        self._carrying: list[_Request] | None = None

    # ---- public API (any thread) ---------------------------------------------------

    def submit(self, req: GenerationRequest) -> RequestStream:
        if self._draining:
            raise EngineDraining("this serving unit is draining: send the request elsewhere")
        self._validate(req)
        if self._inbox.qsize() + len(self._waiting) >= self.settings.engine.max_queue:
            raise EngineFull("server is at capacity: too many queued requests")
        verdict = self._judge(req)
        if verdict.best_effort and self.settings.engine.unattainable_slo == "reject":
            raise SLOUnattainable(verdict.reason)
        with self._live_lock:
            if req.id in self._live_ids:
                raise ValueError(f"request id {req.id!r} is already in flight")
            self._live_ids.add(req.id)
        stream = RequestStream(req.id, verdict)
        self._inbox.put(("submit", (req, stream, self.clock())))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        running = list(self._running.values())
        return EngineStats(
            running=len(running),
            waiting=len(self._waiting),
            tracked=len(running) + len(self._waiting),
            kv_usage=self.target.kv_usage(),
            iterations=self._iterations,
            drafter_healthy=self.drafter is None or self.drafter.healthy,
            scheduler_healthy=self.scheduler.healthy,
            prefilling=sum(r.prefilling for r in running),
        )

    def drain(self) -> None:
        """Stop taking requests; those already submitted run to the end."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    def loop_age_s(self) -> float:
        """Seconds since the loop last made progress (0 before it starts): a forward
        that never returns shows here while every other thread still answers."""
        return 0.0 if self._beat is None else max(self.clock() - self._beat, 0.0)

    def load(self) -> UnitLoad:
        """This unit's load as routers read it (adaserve/routing.py): occupancy, the
        predicted TPOT at each batch size up to max_running, the tightest SLO it holds
        and its prefill queue. Safe from any thread; cheap enough for every request."""
        running = list(self._running.values())
        waiting = list(self._waiting)
        held = [r.req.tpot_slo_ms for r in [*running, *waiting] if not r.best_effort]
        max_running = self.settings.engine.max_running
        sizes = sorted({*(1 << i for i in range(max_running.bit_length())), max_running})
        n = self.settings.engine.max_batch_tokens
        load = UnitLoad(
            running=len(running),
            waiting=len(waiting) + self._inbox.qsize(),
            max_running=max_running,
            kv_usage=self.target.kv_usage(),
            tpot_curve=tuple((b, self.predicted_tpot_ms(b)) for b in sizes),
            tightest_slo_ms=min(held, default=0.0),
            prefill_queue_tokens=sum(left for _, left in self._prefill_queue),
            prefill_ms_per_token=self._iteration_ms(0, n) / n,
            draining=self._draining,
        )
        self._export_load(load, running)
        return load

    def predicted_tpot_ms(self, n: int) -> float:
        """TPOT of a request in a decode batch of n: the model's (`modelled_tpot_ms`)
        times how far what requests here actually waited per token lately is from the
        model at the batch size they ran at (prefill chunks riding along, host work,
        acceptance unlike the setting's: all in the measurement)."""
        model = self.modelled_tpot_ms(n)
        if self._tpot_seen is None:
            return model
        seen_ms, seen_batch = self._tpot_seen
        at = self.modelled_tpot_ms(max(round(seen_batch), 1))
        return model * min(max(seen_ms / at, 0.5), 4.0) if at > 0 else model

    def _observe_tpot(self, batch: int, emitted: int, iteration_ms: float) -> None:
        if emitted <= 0 or not iteration_ms > 0:
            return
        ms = iteration_ms * batch / emitted  # per token of one request
        if self._tpot_seen is None:
            self._tpot_seen = (ms, float(batch))
            return
        a = 0.1  # ~10 iterations: follows load within a second, not each iteration's noise
        seen_ms, seen_batch = self._tpot_seen
        self._tpot_seen = (seen_ms + a * (ms - seen_ms), seen_batch + a * (batch - seen_batch))

    def modelled_tpot_ms(self, n: int) -> float:
        """TPOT of a request in a decode batch of n by the model alone: the plan's
        iteration (tree tokens on the latency model, plus the draft phase it measured)
        over the tokens a request gets per iteration (the bonus plus each chain level
        with probability alpha^j; fewer levels where the budget runs out)."""
        budget = self.settings.scheduler.budget
        a = self._adaptive()
        depth, width = plan_depth_width(n, budget, a) if self.drafter is not None else (0, 1)
        tokens = min(max(budget, n), n * (1 + depth * width))
        ms = self.latency.predict_ms(tokens) + (self._draft_ms if depth else 0.0)
        levels = min(depth, max(tokens // max(n, 1) - 1, 0))
        return ms / sum(a.acceptance**j for j in range(levels + 1))

    def _export_load(self, load: UnitLoad, running: list[_Request]) -> None:
        """The autoscaling signals: whether this unit can take more at its SLOs."""
        metrics.slo_pressure.set(load.pressure)
        metrics.predicted_tpot_seconds.set(load.tpot_ms(load.running + load.waiting + 1) / 1000.0)
        metrics.predicted_queue_seconds.set(
            load.prefill_queue_tokens * load.prefill_ms_per_token / 1000.0
        )
        now = self.clock()
        decoding = [r for r in running if r.first_token_t is not None and not r.best_effort]
        # On track: its TPOT so far is within its SLO (what attainment will say of it).
        on_track = 0
        for r in decoding:
            elapsed_ms, decoded = self._elapsed_decoded(r, now)
            on_track += elapsed_ms <= r.req.tpot_slo_ms * max(decoded, 1)
        metrics.running_on_slo_ratio.set(on_track / len(decoding) if decoding else 1.0)
        metrics.draining.set(float(load.draining))

    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.model_name,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(self.target.eos_token_ids),
            baseline_tpot_ms=self.baseline_tpot_ms,
            baseline=self.baseline,
            speculative=self.drafter is not None or self.ngram is not None,
            slo_floor_ms=self.slo_floor().tpot_ms,
            speculation_methods=self.methods,
            quantization=self.quantization,
        )

    def start(self, executor: Executor | None = None) -> None:
        """Run the loop on a thread of its own, or on `executor` (the services pass the
        single thread that loaded the models: adaserve/torch_thread.py says why)."""
        if executor is not None:
            self._loop_done = executor.submit(self._loop)
            return
        self._thread = threading.Thread(target=self._loop, name="adaserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.scheduler.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._loop_done is not None:
            wait([self._loop_done], timeout=30)

    # ---- the loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._beat = self.clock()
            if not self.has_work():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                self._recalibrate()
            try:
                self.step()
            except Exception:  # failure isolation itself failed: fail the batch, go on
                log.exception("engine iteration failed; failing the running requests")
                for r in list(self._running.values()):
                    self._finish(r, "error", error="internal error in the engine iteration")

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or not self._inbox.empty())

    def step(self) -> None:
        """One iteration: intake, then one forward carrying the trees of the decoding
        requests and the prefill chunks that fit beside them. A failure ends only the
        requests it concerns (adaserve/isolation.py)."""
        self._carrying = None
        try:
            self._iterate()
        except Exception as exc:
            self._iteration_failed(exc)

    def _iterate(self) -> None:
        start = self.clock()
        self._drain_inbox()
        self._expire_deadlines()
        self._admit()
        self._prefill_queue = tuple(
            (r.ttft_deadline, r.prefill_target - r.prefilled)
            for r in [*self._waiting, *self._running.values()]
            if r.prefilling
        )
        if not self._running:
            self._flush_releases()
            return
        t0 = self.clock()
        step = self._form_step()
        # Cut before selection, so the budget goes to nodes the window can hold.
        trees = self._fit_context(step.decoding, self._speculate(step))
        t1 = self.clock()
        selected = self._select(step, trees)
        selected, logits = self._constrain(step.decoding, selected)
        # Requests whose own work failed so far are gone; the rest may still be preempted.
        step, selected = self._fit_kv(*_alive(step, selected))
        self._carrying = step.carried
        t2 = self.clock()
        items = [
            VerifyItem(
                r.req.id,
                tree,
                r.req.sampling,
                r.generator,
                r.req.sampling.max_tokens - r.num_generated,
                logits.get(r.req.id),
            )
            for r, tree in zip(step.decoding, selected, strict=True)
        ]
        result = self.target.forward(items, [c for _, c in step.chunks])
        t3 = self.clock()
        self._keep_features(step, result)
        for r, tree, res in zip(step.decoding, selected, result.verified, strict=True):
            with self._guard(r, "apply"):
                self._record_spec(r.source, tree, res.accepted_nodes, len(res.emitted_tokens))
                self._apply(r, res.emitted_tokens.tolist(), t3, res.logprobs)
        if step.decoding:
            emitted = sum(len(res.emitted_tokens) for res in result.verified)
            self._observe_tpot(len(step.decoding), emitted, (t3 - start) * 1000.0)
        first_lp = result.first_logprobs or [None] * len(step.chunks)
        prompt_lp = result.prompt_logprobs or [None] * len(step.chunks)
        for (r, chunk), first, lp, plp in zip(
            step.chunks, result.first_tokens, first_lp, prompt_lp, strict=True
        ):
            r.prefilled += len(chunk.tokens)
            if plp is not None:
                r.prompt_lp.append(plp)
            if first is not None:
                with self._guard(r, "apply"):
                    self._apply(r, [first], t3, lp, self._prompt_logprobs(r))
        # A suspect is cleared by a tree of its own: a prompt chunk may not be what broke.
        together = set(self._quarantine.passed([r.req.id for r in step.decoding]))
        for r in [r for r in self._running.values() if r.req.id in together]:
            exc = RuntimeError("iterations fail whenever it runs with others")
            self._fail(r, "batch", exc, traceback=False)
        self._observe_iteration(step, selected, t0, t1, t2, t3)
        if self._recompute:
            self._recompute_features()
        self._flush_releases()
        # The rest of the step (intake, admission bookkeeping, stop checks, detokenizing,
        # streaming): host time every running request waits, outside the model phases.
        if step.decoding:
            host = self.clock() - start - (t3 - t0)
            metrics.iteration_seconds.labels("host").observe(max(host, 0.0))

    # ---- iteration phases ----------------------------------------------------------

    def _keep_features(self, step: _Step, result) -> None:
        """The features the forward computed, kept for the requests an EAGLE drafter
        drafts: a tree's root and accepted path are the rows its new tokens need (the
        root's own position first), a chunk's rows those of its tokens."""
        if result.tree_features is not None:
            for r, rows in zip(step.decoding, result.tree_features, strict=True):
                if r.feats is not None:
                    r.feats.add(len(r.tokens) - 1, rows)
        if result.chunk_features is not None:
            for (r, c), rows in zip(step.chunks, result.chunk_features, strict=True):
                if r.feats is not None:
                    r.feats.add(c.start, rows)

    def _form_step(self) -> _Step:
        """Which requests draft (and how deep), which prompts get a chunk of how many
        tokens, and the tree budget selection may spend (adaserve/batching.py)."""
        running = self._eligible()
        decoding = [r for r in running if not r.prefilling]
        prefilling = [r for r in running if r.prefilling]
        drafted, depth, width = self._plan(decoding, len(prefilling))
        adaptive = self._adaptive()
        sched = self.settings.scheduler
        yields = sched.policy == "adaserve" and sched.yield_to_prefill
        now = self.clock()
        progress = [
            Decoding(r.req.id, r.req.tpot_slo_ms, *self._elapsed_decoded(r, now)) for r in decoding
        ]
        prompts = [
            Prefilling(
                r.req.id,
                r.prefill_target - r.prefilled,
                r.ttft_deadline * 1000.0,
                r.req.priority,
                r.arrival * 1000.0,
                r.prefilled,
                r.req.ttft_slo_ms is not None and r.num_generated == 0,
            )
            for r in prefilling
        ]

        def plan(drafted: list[_Request], depth: int, width: int) -> BatchPlan:
            eng = self.settings.engine
            # The trees' size for the token split: the model's plan, else n-gram chains
            # where a request may get one (they cost no draft step, only verify tokens).
            tree_depth, tree_width = (depth, width) if drafted else (0, 1)
            if not drafted and self.ngram and any(r.method in USES_NGRAM for r in decoding):
                tree_depth = self.settings.speculation.ngram.depth
            limits = BatchLimits(
                tree_budget=self._tree_budget(decoding, depth if drafted else 0, adaptive),
                max_batch_tokens=eng.max_batch_tokens,
                min_prefill_tokens=eng.min_prefill_tokens,
                stretch=eng.prefill_stretch,
                depth=tree_depth,
                width=tree_width,
                acceptance=adaptive.acceptance,
                yield_tokens=yields,
            )
            return form_batch(
                progress,
                prompts,
                limits,
                self._iteration_ms,
                self._draft_ms if drafted else 0.0,
                now * 1000.0,
                # What a decode-only iteration of this batch has taken, drafting and
                # selection included: the work a prefill chunk may stretch.
                self.tspec.measured_ms(self._decode_tokens(decoding, tree_depth, tree_width)),
            )

        batch = plan(drafted, depth, width)
        if yields and drafted and batch.ttft_short:
            # Speculation yields to prefill: the deadlines need more than this iteration
            # carries, and its draft step is time the prompts lose. Draft only for those
            # plain decoding would leave behind their TPOT SLO (where none is, this is a
            # continuous-batching iteration); their SLO trees stay in the plan.
            behind = self._behind_without_drafts(drafted, self.tspec.predict_ms(len(decoding)))
            drafted = [r for r, b in zip(drafted, behind, strict=True) if b]
            if len(drafted) < len(behind):  # (at the planned depth: a smaller batch's
                batch = plan(drafted, depth, width)  # deeper plan would cost prefill more)
        self._ttft_short = batch.ttft_short
        chunks = []
        for rid, n in batch.chunks:
            r = self._running[rid]
            toks = np.asarray(r.tokens[r.prefilled : r.prefilled + n], dtype=np.int32)
            # The chunk that completes a prompt samples the first token; one that
            # completes a preempted request's recompute does not (its root is known).
            last = r.prefilled + n == r.prefill_target and r.num_generated == 0
            logits = None
            if last and r.req.sampling.processes_logits:
                with self._guard(r, "prefill"):
                    first_masks = None
                    if r.constraint is not None:
                        first_masks = r.constraint.tree_masks(CandidateTree.root_only(0))[1]
                    logits = self._logits_context(r, first_masks)
                if r.finished:
                    continue
            scored, k = None, 0
            if r.scores_prompt:
                if r.prefilled == 0:  # (again, after a preemption): from the start
                    r.prompt_lp = []
                prompt = r.req.prompt_token_ids
                scored = np.asarray(
                    prompt[r.prefilled + 1 : min(r.prefilled + n + 1, len(prompt))],
                    dtype=np.int32,
                )
                k = r.req.sampling.prompt_logprobs or 0
            chunk = PrefillChunk(
                rid, toks, r.prefilled, last, r.req.sampling, r.generator, logits, scored, k
            )
            chunks.append((r, chunk))
        return _Step(decoding, drafted, depth, width, chunks, batch)

    def _tree_budget(self, decoding: list[_Request], depth: int, adaptive: AdaptiveSettings) -> int:
        """This iteration's tree budget: the knee B, or (policy adaserve with
        `slo_budget`) what the tightest decoding request's SLO lets the forward take."""
        sched = self.settings.scheduler
        if sched.policy != "adaserve" or not sched.slo_budget or not decoding or depth <= 0:
            return sched.budget
        return slo_tree_budget(
            min(r.req.tpot_slo_ms for r in decoding),
            chain_tokens(adaptive.acceptance, depth),
            self._draft_ms,
            lambda t: self.latency.predict_ms(t),
            sched.budget,
            self.settings.engine.max_batch_tokens,
        )

    def _decode_tokens(self, decoding: list[_Request], depth: int, width: int) -> int:
        """Tree tokens a decode-only iteration of this batch verifies at most."""
        n = len(decoding)
        return min(max(self.settings.scheduler.budget, n), n * (1 + depth * width))

    def _iteration_ms(self, tree_tokens: int, prefill_tokens: int, context: float = 0.0) -> float:
        """Predicted forward latency, plus the drafter's ingestion of the chunks."""
        return self.latency.predict_ms(tree_tokens, prefill_tokens, context) + (
            prefill_tokens * self._ingest_ms
        )

    def _plan(self, batch: list[_Request], prefilling: int) -> tuple[list[_Request], int, int]:
        """(requests to draft for, depth, width). d and w are a pure function of n and
        the settings this process already holds: planning locally saves one of the three
        round trips of a gRPC iteration (the scheduler service keeps `Plan` for others)."""
        # Only requests whose method may use the model draft with it; the others still
        # count in the load the plan is for.
        now = self.clock()
        for r in batch:
            # Behind its TPOT SLO so far (as the prompt hold judges it, after enough
            # tokens for that to mean something): a relaxed request is drafted for.
            elapsed, decoded = self._elapsed_decoded(r, now)
            r.needs_drafts = behind_tpot([Decoding(r.req.id, r.req.tpot_slo_ms, elapsed, decoded)])
        if self.drafter is None or not any(self._draftable(r) for r in batch):
            return [], 0, 1
        budget, adaptive = self.settings.scheduler.budget, self._adaptive()
        # Plan for the batch the next iterations run: requests being prefilled and
        # those that arrived during this step join it soon. Otherwise the first request
        # of a burst drafts deep alone while the rest are prefilled. An abort queued
        # there counts too: an overestimate for one iteration at most.
        arriving = self._inbox.qsize()
        n = min(len(batch) + prefilling + arriving, self.settings.engine.max_running)
        depth, width = plan_depth_width(n, budget, adaptive)
        if depth > 0:
            # Policy adaserve: planned for the tree tokens the tightest SLO allows.
            slo_budget = self._tree_budget(batch, depth, adaptive)
            if slo_budget > budget:
                depth, width = plan_depth_width(n, slo_budget, adaptive)
            return [r for r in batch if self._draftable(r)], depth, width
        # Drafting for the whole batch does not pay, but SLO comes before throughput.
        # Requests that plain decoding would leave behind their SLO still get trees, and
        # so do the tightest-SLO requests where the others' slack pays for the longer
        # iteration (adaptive.slack_plan).
        t_plain = self.tspec.predict_ms(len(batch))
        behind = self._behind_without_drafts(batch, t_plain)
        tight, slack_depth = slack_plan(
            np.array([r.req.tpot_slo_ms for r in batch]),
            t_plain,
            budget,
            adaptive,
        )
        drafted = [
            r
            for r, b, t in zip(batch, behind, tight, strict=True)
            if (b or t) and self._draftable(r)
        ]
        if not drafted:
            return [], 0, width
        depth, width = plan_depth_width(len(drafted), budget, adaptive)
        return drafted, slack_depth or depth, width

    def _draftable(self, r: _Request) -> bool:
        """Whether the model drafter drafts for `r` (and ingests its prompt)."""
        return r.method in self._uses_drafter and not (r.plain and not r.needs_drafts)

    def _relaxed(self, r: _Request) -> bool:
        """At admission (policy adaserve with `scheduler.draft_relaxed` off): whether
        `r` decodes plainly, not drafted for unless it falls behind its SLO. So when
        it shares the engine with other requests that have a TTFT SLO (prompts whose
        prefill the drafter's would delay, now or as they keep arriving) and `r`'s TPOT
        SLO is met by plain decoding of a full batch with every
        iteration stretched by prefill (prefill_stretch x the predicted plain iteration
        at max_running). Drafting for it would buy speed its SLO does not count, and
        costs the drafter's prefill of its prompt, target-side time every waiting
        prompt's TTFT pays for (a 4k-token prompt costs a small drafter ~0.1 s on the
        H100 profile): on prefill-heavy load that made speculation lose to not
        speculating (BENCHMARKS.md, "Random workloads"). Decided once: a request that
        switched back to drafting later would make the drafter catch up on its whole
        prompt in one forward, a stall for every request in it."""
        sched = self.settings.scheduler
        if sched.policy != "adaserve" or sched.draft_relaxed:
            return False
        # Only where its prompt outweighs its output: the drafter's prefill grows with
        # the prompt, what drafts save with the output. A short prompt's request is
        # drafted for: finishing sooner frees its running slot for the prompts behind
        # it (the random sweep's draw 2 lost 0.23 of attainment to spec-4 without this).
        if len(r.req.prompt_token_ids) < r.req.sampling.max_tokens:
            return False
        if not any(
            w is not r and w.req.ttft_slo_ms is not None
            for w in [*self._waiting, *self._running.values()]
        ):
            return False
        eng = self.settings.engine
        plain_ms = self.tspec.predict_ms(eng.max_running) * eng.prefill_stretch
        return r.req.tpot_slo_ms >= plain_ms

    def _adaptive(self) -> AdaptiveSettings:
        """The depth/width settings, with the learned acceptance where it is learned."""
        adaptive = self.settings.scheduler.adaptive
        if self.acceptance is None:
            return adaptive
        return adaptive.model_copy(update={"acceptance": self.acceptance.alpha})

    def _behind_without_drafts(self, batch: list[_Request], t_plain_ms: float) -> np.ndarray:
        """Which requests need more than the bonus token this iteration, A(r) > 1, if
        the iteration is a plain decoding step of the whole batch."""
        progress = self._progress(batch)
        a = required_accepted(
            np.array([p.elapsed_ms for p in progress]),
            np.array([p.decoded for p in progress], dtype=np.float64),
            np.array([p.tpot_slo_ms for p in progress]),
            t_plain_ms,
        )
        return a > 1.0

    def _elapsed_decoded(self, r: _Request, now: float) -> tuple[float, int]:
        """(l_r ms since the first token, o_r tokens decoded since it)."""
        elapsed = (now - r.first_token_t) * 1000.0 if r.first_token_t else 0.0
        return elapsed, max(r.num_generated - 1, 0)

    def _progress(self, batch: list[_Request]) -> list[RequestProgress]:
        now = self.clock()
        return [
            RequestProgress(r.req.id, r.req.tpot_slo_ms, *self._elapsed_decoded(r, now))
            for r in batch
        ]

    def _speculate(self, step: _Step) -> list[CandidateTree]:
        """Trees for the decoding requests, each from the source its speculation method
        picks this iteration (adaserve/methods.py); root-only for the rest (a drafter
        catches up on their tokens the next time it sees them). The n-gram drafter goes
        first: it costs no forward, and `auto` reads its trees to decide which requests
        the model drafts for. The same calls hand each drafter this iteration's prefill
        chunks of the requests whose method may use it."""
        roots = [CandidateTree.root_only(r.tokens[-1]) for r in step.decoding]
        for r in step.decoding:
            r.source = "none"
        if self.drafter is None and self.ngram is None:
            return roots
        ng = self.settings.speculation.ngram
        # Where its trees do not pay, `auto` spends no lookups either (they are host
        # time every request waits for); the requests catch up on their next lookup.
        pays = self.ngram is not None and self._ngram_pays(len(step.decoding))
        looked_up = [
            r for r in step.decoding if r.method == "ngram" or (pays and r.method in USES_NGRAM)
        ]
        t0 = self.clock()
        ngram = self._draft(
            self.ngram,
            "ngram_len",
            looked_up,
            [(r, c) for r, c in step.chunks if r.method in USES_NGRAM],
            ng.depth,
            ng.width,
            0.0,  # selection prunes its unlikely nodes; drafting them costs no forward
        )
        self._ngram_lookup_ms = (self.clock() - t0) * 1000.0 if looked_up else 0.0
        calibration = self.method_stats["ngram"].calibration
        ngram = {rid: scale_f(t, calibration) for rid, t in ngram.items()}
        planned = {r.req.id for r in step.drafted} if step.depth > 0 else set()
        alpha = self._adaptive().acceptance
        model_tokens = chain_tokens(alpha, step.depth)
        share = self._model_draft_ms / max(self.tspec.predict_ms(len(step.decoding)), 1e-6)
        for r in step.decoding:
            r.source = choose_source(
                r.method,
                r.req.id in planned,
                expected_tokens(ngram.get(r.req.id)),
                model_tokens,
                share,
                self.drafter is not None,
                self.ngram is not None,
                pays,
            )
            r.source = drafter_source(r.source, self.drafter_kind)
        drafted = [r for r in step.decoding if uses_drafter(r.source)]
        t0 = self.clock() if drafted else 0.0
        model = self._draft(
            self.drafter,
            "drafter_len",
            drafted,
            [(r, c) for r, c in step.chunks if self._draftable(r)],
            step.depth,
            step.width,
            self.settings.scheduler.adaptive.draft_stop_prob or 0.0,
        )
        if drafted and model:  # what auto weighs against an n-gram tree alone
            ms = (self.clock() - t0) * 1000.0
            self._model_draft_ms += 0.3 * (ms - self._model_draft_ms)
        trees = list(roots)
        for i, r in enumerate(step.decoding):
            rid = r.req.id
            with self._guard(r, "tree"):
                if r.source.endswith("+ngram"):
                    trees[i] = merge_trees(model.get(rid, roots[i]), ngram.get(rid, roots[i]))
                elif r.source in ("model", "eagle", "ngram"):
                    trees[i] = (ngram if r.source == "ngram" else model).get(rid, roots[i])
        return trees

    def _ngram_pays(self, n: int) -> bool:
        """Whether verifying n-gram trees pays for a batch of n (adaptive.ngram_pays):
        with what its trees measured per verification (tokens emitted, draft tokens
        verified: decayed counts, SourceStats), or while that evidence is thin (at
        first, and again once it has faded after the trees stopped paying, which so
        tries them again) chains at its learned per-level acceptance; and its measured
        host time per request in token-units of this batch's iteration."""
        budget = self.settings.scheduler.budget
        unit_ms = self.tspec.measured_ms(n) / (budget + n)
        host = self._ngram_host_ms / max(unit_ms, 1e-6)
        seen = self.method_stats["ngram"]
        if seen.steps >= NGRAM_EVIDENCE_STEPS:
            return ngram_pays(n, budget, seen.tokens_per_step, seen.drafted / seen.steps, host)
        depth = np.arange(1, max(self.settings.speculation.ngram.depth, 1) + 1)
        chains = [chain_tokens(self.ngram_acceptance.alpha, int(d)) for d in depth]
        return ngram_pays(n, budget, np.array(chains), depth, host)

    def _draft(
        self,
        drafter: FallbackDrafter | None,
        synced: Literal["drafter_len", "ngram_len"],
        requests: list[_Request],
        chunks: list[tuple[_Request, PrefillChunk]],
        depth: int,
        width: int,
        stop_prob: float,
    ) -> dict[str, CandidateTree]:
        """One drafter's trees for `requests` (by id; none where it failed), sending
        each the tokens it does not hold yet (`synced` names the request's count of
        them) and ingesting the prompt `chunks`."""
        if drafter is None:
            return {}
        if drafter is self.drafter and self._feature_dim:
            updates = self._eagle_updates(requests, chunks)
        else:
            updates = [
                DraftUpdate(
                    r.req.id, np.asarray(r.tokens[getattr(r, synced) :], np.int32), len(r.tokens)
                )
                for r in requests
            ]
            for r, c in chunks:
                end = c.start + len(c.tokens)
                new = np.asarray(r.tokens[getattr(r, synced) : end], np.int32)
                updates.append(DraftUpdate(r.req.id, new, end, ingest=True))
        if not updates:
            return {}
        trees = drafter.speculate(updates, depth, width, stop_prob)
        if not drafter.ok:
            return {}
        lost = set(drafter.lost)
        for u in updates:
            if u.id in lost:
                continue
            r = self._running[u.id]
            setattr(r, synced, u.total_len)
            if u.hidden is not None and r.feats is not None:
                r.feats.drop_before(u.total_len - 1)  # the next token's row stays
        self._recompute |= lost
        return {
            u.id: t
            for u, t in zip(updates, trees, strict=True)
            if not u.ingest and u.id not in lost
        }

    def _eagle_updates(
        self, requests: list[_Request], chunks: list[tuple[_Request, PrefillChunk]]
    ) -> list[DraftUpdate]:
        """Updates for an EAGLE drafter: each request's tokens from what the drafter
        holds up to the last one whose preceding position's features the target has
        computed, with those rows. A decoding request's chain must reach its root;
        where it cannot (its features are gone), it gets none and its features are
        recomputed (`_recompute_features`). Prompt chunks go in one iteration late:
        the features a chunk's tokens need come from the forward that prefills it."""
        updates = []
        for r in requests:
            rows = None if r.feats is None else r.feats.window(r.drafter_len - 1, len(r.tokens) - 1)
            if rows is None:
                self._recompute.add(r.req.id)
                continue
            new = np.asarray(r.tokens[r.drafter_len :], np.int32)
            updates.append(DraftUpdate(r.req.id, new, len(r.tokens), hidden=rows))
        for r, _ in chunks:
            if r.feats is None:
                continue
            end = min(r.feats.hi + 1, len(r.tokens))
            rows = r.feats.window(r.drafter_len - 1, end - 1)
            if end <= r.drafter_len or rows is None:
                continue
            new = np.asarray(r.tokens[r.drafter_len : end], np.int32)
            updates.append(DraftUpdate(r.req.id, new, end, ingest=True, hidden=rows))
        return updates

    def _select(self, step: _Step, trees: list[CandidateTree]) -> list[CandidateTree]:
        if all(len(t) == 1 for t in trees):
            return trees
        n = len(trees)
        budget = max(step.batch.tree_budget, n)  # every root must fit
        # The iteration's predicted latency: a decode step of the budget, plus what the
        # prefill chunks riding along add to the forward.
        prefill = step.batch.prefill_tokens
        extra = 0.0
        if prefill:
            extra = self._iteration_ms(budget, prefill) - self._iteration_ms(budget, 0)
        t_spec_ms = self.tspec.measured_ms(budget) + extra
        # A_cap = min(A, d + 1) with d the deepest tree (n-gram trees outgrow the plan).
        depth = max(step.depth, max(int(t.depths().max()) for t in trees))
        params = selection_params(self.settings.scheduler, depth, t_spec_ms, n, budget)
        progress = self._progress(step.decoding)
        selection = self.scheduler.select(progress, trees, params)
        if selection.invalid:
            selection = self._optimal_invalid(progress, trees, params)
        return [t.subtree(idx) for t, idx in zip(trees, selection.selected, strict=True)]

    def _fit_context(
        self, decoding: list[_Request], trees: list[CandidateTree]
    ) -> list[CandidateTree]:
        """Each tree cut to the context window: its node at depth d would sit at position
        len(tokens) - 1 + d (an n-gram tree of a request near the end outgrows it)."""
        out = list(trees)
        for i, (r, tree) in enumerate(zip(decoding, trees, strict=True)):
            room = self.max_model_len - len(r.tokens)
            if len(tree) > 1:
                with self._guard(r, "tree"):
                    depths = tree.depths()
                    if int(depths.max()) > room:
                        out[i] = tree.subtree(np.nonzero(depths <= room)[0])
        return out

    def _constrain(
        self, decoding: list[_Request], trees: list[CandidateTree]
    ) -> tuple[list[CandidateTree], dict[str, LogitsContext | None]]:
        """Structured output: each constrained tree without the branches its grammar
        rejects (they could never be accepted); and by request id what the target needs
        to process its rows (the grammar's mask at every node that is left included)."""
        logits: dict[str, LogitsContext | None] = {}
        out = list(trees)
        for i, r in enumerate(decoding):
            with self._guard(r, "constrain"):
                masks = None
                if r.constraint is not None:
                    out[i], masks = r.constraint.tree_masks(trees[i])
                logits[r.req.id] = self._logits_context(r, masks)
        return out, logits

    def _logits_context(self, r: _Request, masks: np.ndarray | None) -> LogitsContext | None:
        """What the target needs to process this request's rows; None: nothing to do."""
        if not r.req.sampling.processes_logits or r.prompt_ids is None:
            return None
        output = np.asarray(r.tokens[r.num_prompt :], dtype=np.int32)
        return LogitsContext(r.req.sampling, r.prompt_ids, output, r.stop_ids, masks)

    def _optimal_invalid(
        self, progress: list[RequestProgress], trees: list[CandidateTree], params: SelectionParams
    ) -> Selection:
        """Policy optimal (Algorithm 1) found no allocation that meets every request's
        A(r) within the budget: this iteration selects with policy adaserve instead."""
        metrics.optimal_invalid_total.inc()
        if not self._optimal_invalid_logged:
            self._optimal_invalid_logged = True
            log.warning(
                "policy optimal: no allocation meets every SLO this iteration; selecting "
                "with policy adaserve where that happens (adaserve_selection_optimal_"
                "invalid_total counts them)"
            )
        return self.local_scheduler.select(progress, trees, replace(params, policy="adaserve"))

    def _fit_kv(
        self, step: _Step, selected: list[CandidateTree]
    ) -> tuple[_Step, list[CandidateTree]]:
        """Preempt until the forward's new KV fits in the free blocks: the trees'
        scratch and the chunks' tokens. The victim is always the running request with
        the lowest priority, then the most slack against its SLO, whoever needs the
        blocks: a relaxed request gives way to a tight one, never the reverse."""
        while True:
            growth = {r.req.id: len(t) for r, t in zip(step.decoding, selected, strict=True)}
            for r, c in step.chunks:
                growth[r.req.id] = growth.get(r.req.id, 0) + len(c.tokens)
            if self.target.blocks_needed(growth) <= self.target.free_blocks():
                return step, selected
            victim = self._victim()
            self._preempt(victim)
            keep = [i for i, r in enumerate(step.decoding) if r is not victim]
            selected = [selected[i] for i in keep]
            step = replace(
                step,
                decoding=[step.decoding[i] for i in keep],
                drafted=[r for r in step.drafted if r is not victim],
                chunks=[(r, c) for r, c in step.chunks if r is not victim],
            )

    def _victim(self) -> _Request:
        now = self.clock()

        def slack_ms(r: _Request) -> float:
            if r.num_generated == 0:  # not started: how long its first token may wait
                return (r.ttft_deadline - now) * 1000.0
            elapsed, decoded = self._elapsed_decoded(r, now)
            return r.req.tpot_slo_ms * (decoded + 1) - elapsed

        return max(self._running.values(), key=lambda r: (r.req.priority, slack_ms(r)))

    def _preempt(self, r: _Request) -> None:
        """Preemption by recompute: free the request's KV (its full blocks stay in the
        prefix cache, so coming back is cheap while they are not evicted) and queue it
        again; it keeps its tokens and its stream, and later recomputes the KV of all but
        its last token in chunks, that token rooting its next tree as before."""
        self.target.free(r.req.id)
        self._release_drafts(r)
        r.prefilled = 0
        r.prefill_target = len(r.tokens) - 1 if r.num_generated else r.num_prompt
        self.preemptions += 1
        del self._running[r.req.id]
        self._waiting.append(r)
        metrics.preemptions_total.inc()
        log.debug("preempted %s (%d tokens) for KV", r.req.id, len(r.tokens))

    def _prompt_logprobs(self, r: _Request) -> TokenLogprobs | None:
        """The prompt's logprobs its prefill gathered, sent with its first token; every
        prompt token but the first must be scored (RuntimeError: the request fails)."""
        if not r.scores_prompt:
            return None
        got = TokenLogprobs.concat(r.prompt_lp) if r.prompt_lp else None
        n = 0 if got is None else got.logprobs.shape[0]
        if n != r.num_prompt - 1 or got is None:
            raise RuntimeError(
                f"prompt logprobs: prefill scored {n} of the prompt's {r.num_prompt - 1} tokens"
            )
        r.prompt_lp = []
        return got

    def _apply(
        self,
        r: _Request,
        emitted: list[int],
        now: float,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: TokenLogprobs | None = None,
    ) -> None:
        """Commit emitted tokens to the request: stop checks, detokenize, stream."""
        if r.finished:
            return
        sp = r.req.sampling
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(self.target.eos_token_ids)
        finish: str | None = None
        kept: list[int] = []
        text = ""
        stopped = False  # a stop string ended it: its held-back tail is never released
        for tok in emitted:
            kept.append(tok)
            if r.detok is not None:
                # One token at a time, as plain decoding feeds it: a speculative step
                # accepts several tokens at once, and the output must end exactly where
                # plain decoding would have stopped on a stop string (token ids, usage,
                # logprobs), including one that spans token boundaries. eos/stop ids
                # are special tokens: skip_special_tokens keeps them out of the text.
                piece, hit_stop = r.detok.add([tok])
                text += piece
                if hit_stop:
                    finish, stopped = "stop", True
                    break
            if tok in stops:
                finish = "stop"
                break
            if r.num_generated + len(kept) >= sp.max_tokens:
                finish = "length"
                break
        if finish is not None and r.detok is not None and not stopped:
            text += r.detok.flush()
        r.tokens.extend(kept)
        if r.constraint is not None and not r.constraint.advance(kept):
            self._finish(r, "error", error="structured output: the grammar refused a token")
            return
        first = r.first_token_t is None and bool(kept)
        if first:
            r.first_token_t = now
        if kept:
            r.last_token_t = now
        if len(r.tokens) + 1 >= self.max_model_len and finish is None:
            finish = "length"
            if r.detok is not None:
                text += r.detok.flush()
        r.stream.put(
            TokenDelta(
                token_ids=tuple(kept),
                text=text,
                finish_reason=finish,
                num_prompt_tokens=r.num_prompt,
                num_generated=r.num_generated,
                ttft_ms=(now - r.arrival) * 1000.0 if first else None,
                best_effort=r.best_effort,
                logprobs=None if logprobs is None else logprobs.head(len(kept)),
                prompt_logprobs=prompt_logprobs,
            )
        )
        if finish is not None:
            self._retire(r, finish)

    # ---- admission -----------------------------------------------------------------

    def _validate(self, req: GenerationRequest) -> None:
        sp = req.sampling
        if not req.prompt_token_ids:
            raise ValueError("prompt is empty")
        if sp.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (req.tpot_slo_ms > 0 and math.isfinite(req.tpot_slo_ms)):
            raise ValueError("tpot_slo_ms must be a positive number")
        if len(req.prompt_token_ids) >= self.kv_tokens:
            raise ValueError(
                f"prompt ({len(req.prompt_token_ids)} tokens) is longer than the KV cache "
                f"holds ({self.kv_tokens} tokens; engine.kv_memory_gb / kv_blocks size it)"
            )
        if len(req.prompt_token_ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({sp.max_tokens}) "
                f"exceeds the model's context length ({self.max_model_len})"
            )
        vocab = self.target.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in sp.token_ids()):
            raise ValueError(
                f"logit_bias, allowed_token_ids and bad_words: token ids must be in [0, {vocab})"
            )
        if sp.structured is not None:
            if self.grammar is None:
                raise ValueError(f"{sp.structured.field}: this unit has no tokenizer")
            if sp.ignore_eos:
                raise ValueError(f"{sp.structured.field}: cannot be combined with ignore_eos")
        if sp.temperature < 0 or not (0 < sp.top_p <= 1) or sp.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 are required")
        check_available(self._method(req), self.methods)

    def _method(self, req: GenerationRequest) -> str:
        """The request's speculation method: its own, its SLO class's, the default."""
        cls = self.settings.slo.classes.get(req.slo_class or "")
        return resolve_method(
            req.speculation,
            cls.speculation if cls is not None else None,
            self.settings.speculation.default_method,
        )

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "submit":
                req, stream, arrival = item[1]
                r = self._new_request(req, stream, arrival)
                self._waiting.append(r)
                with self._guard(r, "intake"):
                    self._prepare(r)
            else:
                self._abort(item[1])

    def _new_request(
        self, req: GenerationRequest, stream: RequestStream, arrival: float
    ) -> _Request:
        ttft = req.ttft_slo_ms if req.ttft_slo_ms is not None else UNSET_TTFT_ORDER_MS
        sp = req.sampling
        r = _Request(
            req=req,
            stream=stream,
            arrival=arrival,
            tokens=list(req.prompt_token_ids),
            detok=None,
            generator=self.target.make_generator(sp.seed),
            ttft_deadline=arrival + ttft / 1000.0,
            prefill_target=len(req.prompt_token_ids),
            method=self._method(req),
            stop_ids=tuple(sp.stop_token_ids)
            + (() if sp.ignore_eos else tuple(self.target.eos_token_ids)),
        )
        if sp.processes_logits:
            r.prompt_ids = np.asarray(req.prompt_token_ids, dtype=np.int32)
        if self._feature_dim and r.method in USES_EAGLE:
            r.feats = FeatureRows(self._feature_dim)
        r.best_effort = self._judge_best_effort(r)
        return r

    def _prepare(self, r: _Request) -> None:
        """The request's own helpers: its detokenizer (stop strings) and grammar matcher."""
        if self.tokenizer is not None:
            r.detok = IncrementalDetokenizer(self.tokenizer, stop=tuple(r.req.sampling.stop))
        structured = r.req.sampling.structured
        if structured is not None and self.grammar is not None:
            try:  # compiled at submit by the service already: cached, cheap
                r.constraint = self.grammar.constraint(structured, r.stop_ids)
            except (ValueError, RuntimeError) as exc:  # the client's grammar: its message
                self._finish(r, "error", error=str(exc))

    def _admit(self) -> None:
        """Admit in (priority, due time) order (`_admission_order`) while a running slot
        and free KV blocks above the watermark remain. Nothing is reserved ahead: a request holds blocks
        for what it has committed plus its current scratch, taken as it grows (and
        freed by preemption when they run out), so no request's size blocks another's
        admission. The prompt's longest cached prefix is taken from the prefix cache
        here; admitted requests are prefilled in chunks by the next iterations."""
        if not self._waiting:
            return
        now = self.clock()
        self._waiting.sort(key=lambda r: self._admission_order(r, now))
        watermark = math.ceil(self.settings.engine.kv_watermark * self.target.num_blocks)
        # n > 1: a sibling waits until the prompt it shares is prefilled, then takes
        # that KV from the prefix cache instead of computing it again.
        unprefilled = {r.req.id for r in self._waiting}
        unprefilled |= {r.req.id for r in self._running.values() if r.prefilling}
        hold = self._hold_prompts()
        i = 0
        while i < len(self._waiting) and len(self._running) < self.settings.engine.max_running:
            if self.target.free_blocks() <= watermark:
                break
            r = self._waiting[i]
            if r.req.fork_of is not None and r.req.fork_of in unprefilled:
                i += 1
                continue
            if hold is not None and hold(r):
                i += 1
                continue
            self._waiting.pop(i)
            r.plain = self._relaxed(r)
            tokens = r.tokens[: r.prefill_target]
            self._running[r.req.id] = r
            with self._guard(r, "admit"):
                r.prefilled = self.target.add_sequence(
                    r.req.id, tokens, use_cache=self._use_prefix_cache(r)
                )
                metrics.prefix_cache_queries.inc(len(tokens))
                metrics.prefix_cache_hits.inc(r.prefilled)
        metrics.num_running.set(len(self._running))
        metrics.num_waiting.set(len(self._waiting))

    def _admission_order(self, r: _Request, now: float) -> tuple[int, float, float, float]:
        """The waiting queue's order, which matters when slots or KV gate admission:
        vLLM-style priority first (lower value first), then the earliest due time, then
        the tighter TPOT SLO, then arrival. Due is the TTFT deadline of a request that has
        not started (the one prefill chunks are ordered by), so a tight TTFT SLO is
        admitted ahead of relaxed ones that came first; a request without a TTFT SLO is
        due UNSET_TTFT_ORDER_MS after its arrival, so such requests keep arrival order
        among themselves and none waits forever (past that point no later arrival is due
        before it). A preempted request is due when its next token falls behind its TPOT
        SLO: a fixed instant, so it too reaches the front. `engine.admission_order:
        arrival` keeps vLLM's order instead: priority, then arrival."""
        if self.settings.engine.admission_order == "arrival":
            return (r.req.priority, 0.0, 0.0, r.arrival)
        due = r.ttft_deadline
        if r.num_generated > 0:
            elapsed, decoded = self._elapsed_decoded(r, now)
            due = now + (r.req.tpot_slo_ms * (decoded + 1) - elapsed) / 1000.0
        return (r.req.priority, due, r.req.tpot_slo_ms, r.arrival)

    def _hold_prompts(self) -> Callable[[_Request], bool] | None:
        """Policy adaserve with `scheduler.hold_prompts`, while a decoding request is
        behind its TPOT SLO: which waiting requests stay waiting this iteration (those
        with a TTFT SLO far enough from their deadline, batching.hold_prompt). None: admit
        as usual."""
        sched = self.settings.scheduler
        if sched.policy != "adaserve" or not sched.hold_prompts:
            return None
        now = self.clock()
        decoding = [
            Decoding(r.req.id, r.req.tpot_slo_ms, *self._elapsed_decoded(r, now))
            for r in self._running.values()
            if not r.prefilling and not r.best_effort
        ]
        if not behind_tpot(decoding):
            return None
        if sched.yield_to_prefill and self._ttft_short:
            return None
        n = self.settings.engine.max_batch_tokens
        ms_per_token = self.latency.predict_ms(0, n) / n
        queue = self._prefill_queue

        def hold(r: _Request) -> bool:
            if r.req.ttft_slo_ms is None or r.num_generated > 0:
                return False  # no TTFT SLO to spend, or a preempted request's recompute
            # The queue as of the last iteration: it may hold this prompt already, which
            # then counts twice (the hold errs toward admitting).
            # With `yield_to_prefill`, every prompt queued counts, not only those due
            # before it: prompts that arrive later with earlier deadlines go first, and
            # a hold that misses the TTFT it spends loses more than it saved.
            ahead = sum(
                left for due, left in queue if sched.yield_to_prefill or due <= r.ttft_deadline
            )
            return hold_prompt(r.ttft_deadline, now, ahead + r.prefill_target, ms_per_token)

        return hold

    @property
    def baseline_tpot_ms(self) -> float:
        return self.baseline.tpot_ms

    def slo_floor(self) -> SLOFloor:
        """The best TPOT one request alone can expect now (adaptive.slo_floor), from the
        predicted 1-token iteration and the plan's cost model and acceptance (learned,
        where it is). Read from any thread: submit judges each SLO with it.

        One floor at a time: the value every report reads (/v1/models, /v1/slo, a
        response's `slo`, a best-effort reason) moves only when the freshly computed one
        differs from it by more than FLOOR_HYSTERESIS, so iteration-time noise does not
        give two requests a second apart two floors."""
        a = self._adaptive()
        depth_max = 0
        if self.drafter is not None:
            depth_max = a.fixed_depth if a.policy == "fixed" else a.d_max
        fresh = slo_floor(self.tspec.predict_ms(1), self.settings.scheduler.budget, a, depth_max)
        held = self._floor
        if held is None or abs(fresh.tpot_ms - held.tpot_ms) > FLOOR_HYSTERESIS * held.tpot_ms:
            # 0.001 ms: the precision every report prints, so they print the same number.
            self._floor = held = replace(fresh, tpot_ms=round(fresh.tpot_ms, 3))
        return held

    def _recalibrate(self) -> None:
        """While the engine is idle and its baseline unsettled (adaserve/calibration.py),
        time it again on the retry schedule; a faster result replaces it, and with it
        every SLO class resolved from it, the predicted iteration time, the forward
        latency curve where that was measured too, and the floor."""
        if self._remeasure is None or self.baseline.settled:
            return
        if not self._retry.due(self.clock(), idle=not self.has_work()):
            return
        old = self.baseline
        self.baseline = remeasured(old, self._remeasure.baseline_ms(), cpu_load.current())
        self._retry.tried(self.clock())
        if self.baseline.tpot_ms == old.tpot_ms:
            return
        if self._remeasure.curve is not None:
            c = self._remeasure.curve()
            self.latency = ForwardLatency(Curve(tuple(c.tokens), tuple(c.ms), c.context_ms))
        self.tspec = _TSpecPredictor(self.baseline.tpot_ms, self.tspec.correction)
        slo = self.settings.slo.model_copy(update={"baseline_tpot_ms": self.baseline.tpot_ms})
        self.settings = self.settings.model_copy(update={"slo": slo})
        self._floor = None
        metrics.baseline_tpot_seconds.set(self.baseline.tpot_ms / 1000.0)
        metrics.baseline_recalibrations_total.inc()
        log.info(
            "baseline TPOT re-measured on a %s host: %.2f ms (was %.2f ms, measured at load "
            "%.1f); SLO classes and the floor follow",
            "quiet" if self.baseline.settled else "still busy",
            self.baseline.tpot_ms,
            old.tpot_ms,
            old.load_1m,
        )

    def _judge(self, req: GenerationRequest) -> SLOVerdict:
        """Admission's judgement, at submit (before any token): a TPOT SLO below the
        floor, or a TTFT SLO shorter than prefilling this prompt and those due before it
        takes at the best prefill rate this deployment reaches, is served best-effort."""
        floor = self.slo_floor()
        verdict = judge(req.tpot_slo_ms, floor.tpot_ms, floor.depth)
        ttft = req.ttft_slo_ms
        if verdict.best_effort or ttft is None:
            return verdict
        deadline = self.clock() + ttft / 1000.0
        ahead = sum(left for due, left in self._prefill_queue if due <= deadline)
        n = self.settings.engine.max_batch_tokens
        need_ms = (ahead + len(req.prompt_token_ids)) * self.latency.predict_ms(0, n) / n
        if need_ms <= ttft:
            return verdict
        return SLOVerdict(
            True,
            floor.tpot_ms,
            f"ttft_slo_ms {ttft:g} is below the ~{need_ms:.0f} ms this server needs to "
            f"prefill this prompt ({len(req.prompt_token_ids)} tokens) and the {ahead} "
            "prompt tokens due before it",
        )

    def _judge_best_effort(self, r: _Request) -> bool:
        """An unattainable SLO (judged at submit; policy `best_effort`, as `reject`
        refused it there) is served best-effort and flagged, not refused."""
        if r.stream.verdict.best_effort:
            metrics.best_effort_total.labels(r.req.slo_class or "custom").inc()
            return True
        return False

    # ---- retirement ----------------------------------------------------------------

    def _expire_deadlines(self) -> None:
        now = self.clock()
        for r in [*self._waiting, *self._running.values()]:
            if r.deadline is not None and now > r.deadline:
                self._finish(r, "timeout", error="request deadline exceeded")

    def _abort(self, request_id: str) -> None:
        for r in self._waiting:
            if r.req.id == request_id:
                self._finish(r, "abort")
                return
        r = self._running.get(request_id)
        if r is not None:
            self._finish(r, "abort")

    def _finish(self, r: _Request, reason: str, error: str | None = None) -> None:
        if r.finished:
            return
        delta = TokenDelta(
            token_ids=(),
            text="",
            finish_reason=reason,
            num_prompt_tokens=r.num_prompt,
            num_generated=r.num_generated,
            best_effort=r.best_effort,
            error=error,
        )
        try:
            r.stream.put(delta)
        except Exception as exc:  # a broken stream must not keep the request's state
            log.warning("request %s: its stream refused the final delta (%r)", r.req.id, exc)
        self._retire(r, reason)

    def _retire(self, r: _Request, reason: str) -> None:
        r.finished = True
        with self._live_lock:
            self._live_ids.discard(r.req.id)
        if r in self._waiting:
            self._waiting.remove(r)
        if self._running.pop(r.req.id, None) is not None:
            try:
                self.target.free(r.req.id)
            except Exception:  # its KV accounting is broken: the others' still holds
                log.exception("request %s: freeing its KV failed", r.req.id)
            self._release_drafts(r)
        self._record_finish(r, reason)
        metrics.num_running.set(len(self._running))
        metrics.num_waiting.set(len(self._waiting))

    def _release_drafts(self, r: _Request) -> None:
        if self.drafter is not None and r.drafter_len:
            self.drafter.release([r.req.id])
        if self.ngram is not None and r.ngram_len:
            self.ngram.release([r.req.id])
        r.drafter_len = r.ngram_len = 0
        if r.feats is not None:  # the recompute that follows computes them again
            r.feats = FeatureRows(self._feature_dim)

    # ---- failure isolation (adaserve/isolation.py) -----------------------------------

    @contextmanager
    def _guard(self, r: _Request, phase: str) -> Iterator[None]:
        """Work of one request's own: an exception there ends that request alone."""
        try:
            yield
        except Exception as exc:
            self._fail(r, phase, exc)

    def _fail(self, r: _Request, phase: str, exc: Exception, traceback: bool = True) -> None:
        """Ends a request whose own work failed: "error" to its client, its KV and draft
        state freed as an abort frees them; the other requests go on."""
        if not r.finished:
            self._finish(r, "error", error=report(r.req.id, phase, exc, traceback))

    def _eligible(self) -> list[_Request]:
        """The running requests this iteration may carry: the quarantine's head group
        while it holds suspects, else all."""
        allowed = self._quarantine.allowed(self._running.keys())
        return [r for r in self._running.values() if allowed is None or r.req.id in allowed]

    def _iteration_failed(self, exc: Exception) -> None:
        """The batched part of the iteration raised, so nobody knows whose input broke
        it: the quarantine ends a request that already failed alone and bisects the
        rest. The forward may have appended or committed KV for any of them that their
        tokens do not show yet: their KV is rebuilt from their committed tokens."""
        carried = self._eligible() if self._carrying is None else self._carrying
        carried = [r for r in carried if not r.finished and r.req.id in self._running]
        ids = [r.req.id for r in carried]
        log.error("engine iteration failed carrying %s; isolating them", ids, exc_info=exc)
        culprits = set(self._quarantine.failed(ids))
        for r in carried:
            if r.req.id in culprits:
                self._fail(r, "batch", exc, traceback=False)  # logged just above
            else:
                with self._guard(r, "resync"):
                    self._resync(r)
        self._flush_releases()

    def _resync(self, r: _Request) -> None:
        """Recompute, as after a preemption, without leaving the running set: the KV of
        every committed token but the last (that one roots the next tree) is prefilled
        again, from the prefix cache where its blocks are whole; the drafters re-ingest."""
        self.target.free(r.req.id)
        self._release_drafts(r)
        r.prefill_target = len(r.tokens) - 1 if r.num_generated else r.num_prompt
        r.prefilled = self.target.add_sequence(
            r.req.id, r.tokens[: r.prefill_target], use_cache=self._use_prefix_cache(r)
        )

    def _use_prefix_cache(self, r: _Request) -> bool:
        """Whether the request's prefill may take KV from the prefix cache: not where
        it scores its prompt, nor where an EAGLE drafter needs the features of every
        position (the cache holds KV, not features: a hit would leave a gap)."""
        return not r.scores_prompt and r.feats is None

    def _recompute_features(self) -> None:
        """Requests whose EAGLE drafter lost their state (a restarted drafter service,
        KV given up under pressure) have features only from the drafter's point on:
        the verifier recomputes them, prefilling the request's history again with
        features (as after a failed iteration), and the drafter takes it in full."""
        ids, self._recompute = self._recompute, set()
        for rid in sorted(ids):
            r = self._running.get(rid)
            if r is None or r.finished or r.feats is None:
                continue
            log.info("recomputing the features of %s for its EAGLE drafter", rid)
            metrics.drafter_resyncs_total.inc()
            with self._guard(r, "resync"):
                self._resync(r)

    def _flush_releases(self) -> None:
        for drafter in (self.drafter, self.ngram):
            if drafter is not None:
                drafter.flush()

    def _history(self, request_id: str) -> list[int]:
        """A running request's committed tokens (the drafter re-sync reads them)."""
        return self._running[request_id].tokens

    # ---- observability -------------------------------------------------------------

    def _record_spec(self, source: str, tree: CandidateTree, accepted_nodes, emitted: int) -> None:
        drafted = len(tree) - 1
        accepted = len(accepted_nodes) - 1
        self._record_method(source, tree, drafted, accepted, emitted)
        if drafted == 0:
            return
        metrics.spec_num_drafts.inc()
        metrics.spec_emitted_tokens.inc(emitted)
        metrics.spec_num_draft_tokens.inc(drafted)
        metrics.spec_num_accepted_tokens.inc(accepted)
        for pos in range(accepted):
            metrics.spec_accepted_per_pos.labels(str(pos)).inc()
        if source == "ngram":
            rejected = bool((tree.parents == accepted_nodes[-1]).any())
            self.ngram_acceptance.observe(accepted, rejected)
        if self.acceptance is not None and uses_drafter(source):
            # The plan's acceptance is the model's: the n-gram drafter's trees, free to
            # draft, say nothing about whether its draft steps pay.
            # The run of accepted levels ended in a rejection if the last accepted node
            # had children to choose from; at a leaf the tree just ended (censored).
            rejected = bool((tree.parents == accepted_nodes[-1]).any())
            self.acceptance.observe(accepted, rejected)
            metrics.spec_acceptance_estimate.set(self.acceptance.alpha)

    def _record_method(
        self, source: str, tree: CandidateTree, drafted: int, accepted: int, emitted: int
    ) -> None:
        """Per-method counts (metrics) and the learned estimates `auto` reads. The
        n-gram calibration compares accepted tokens with the f it predicted before its
        calibration was applied (scale_f multiplied f by it)."""
        predicted = float(tree.path_probs().sum()) - 1.0 if drafted else 0.0
        if source == "ngram":
            predicted /= self.method_stats["ngram"].calibration
        self.method_stats[source].observe(emitted, drafted, accepted, predicted)
        metrics.spec_method_steps.labels(source).inc()
        metrics.spec_method_emitted_tokens.labels(source).inc(emitted)
        if drafted:
            metrics.spec_method_draft_tokens.labels(source).inc(drafted)
            metrics.spec_method_accepted_tokens.labels(source).inc(accepted)

    def _observe_iteration(
        self, step: _Step, selected: list[CandidateTree], t0: float, t1: float, t2: float, t3: float
    ) -> None:
        tokens = sum(len(t) for t in selected)
        prefill = step.batch.prefill_tokens
        self.latency.observe(tokens, prefill, step.batch.prefill_context, (t3 - t2) * 1000.0)
        speculate_ms = (t1 - t0) * 1000.0
        drafting = step.depth > 0 and bool(step.drafted)
        if prefill and self.drafter is not None and self.drafter.ok:
            ingest = max(speculate_ms - (self._draft_ms if drafting else 0.0), 0.0) / prefill
            self._ingest_ms += 0.3 * (ingest - self._ingest_ms)
        elif drafting:
            self._draft_ms += 0.3 * (speculate_ms - self._draft_ms)
        if prefill:
            metrics.prefill_tokens_total.inc(prefill)
        if not step.decoding:  # a forward of prompt chunks alone
            metrics.iteration_seconds.labels("prefill").observe(t3 - t2)
            return
        if any(r.source == "ngram" or r.source.endswith("+ngram") for r in step.decoding):
            host = (self._ngram_lookup_ms + (t2 - t1) * 1000.0) / len(step.decoding)
            self._ngram_host_ms += 0.3 * (host - self._ngram_host_ms)
        self._iterations += 1
        if not prefill:  # t_spec predicts decode iterations
            self.tspec.observe(tokens, (t3 - t0) * 1000.0)
        metrics.iterations_total.inc()
        metrics.iteration_seconds.labels("speculate").observe(t1 - t0)
        metrics.iteration_seconds.labels("select").observe(t2 - t1)
        metrics.iteration_seconds.labels("verify").observe(t3 - t2)
        metrics.iteration_seconds.labels("total").observe(t3 - t0)
        metrics.budget_used.observe(tokens)
        if self.acceptance is not None:
            self.acceptance.tick()
        self.ngram_acceptance.tick()
        for source, est in self.method_stats.items():
            est.tick()
            metrics.spec_method_tokens_per_step.labels(source).set(est.tokens_per_step)
            metrics.spec_method_acceptance.labels(source).set(est.acceptance)
        metrics.batch_size.observe(len(step.decoding))
        metrics.kv_usage.set(self.target.kv_usage())

    def _record_finish(self, r: _Request, reason: str) -> None:
        cls = r.req.slo_class or "custom"
        metrics.requests_total.labels(reason, cls).inc()
        if r.first_token_t is None:
            return
        ttft_ms = (r.first_token_t - r.arrival) * 1000.0
        metrics.ttft_seconds.labels(cls).observe(ttft_ms / 1000.0)
        if reason not in ("stop", "length"):
            return
        ttft_met = r.req.ttft_slo_ms is None or ttft_ms <= r.req.ttft_slo_ms
        metrics.ttft_slo_total.labels(cls, "attained" if ttft_met else "missed").inc()
        n = r.num_generated
        if n < 2 or r.last_token_t is None:
            return
        tpot_ms = (r.last_token_t - r.first_token_t) * 1000.0 / (n - 1)
        metrics.tpot_seconds.labels(cls).observe(tpot_ms / 1000.0)
        tpot_met = tpot_ms <= r.req.tpot_slo_ms
        metrics.tpot_slo_total.labels(cls, "attained" if tpot_met else "missed").inc()
        # The SLO is met when both are: a fast stream after a late first token is not.
        if ttft_met and tpot_met:
            metrics.slo_attained_total.labels(cls).inc()
            metrics.goodput_tokens_total.labels(cls).inc(n)
        else:
            metrics.slo_missed_total.labels(cls).inc()
