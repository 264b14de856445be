"""The engine: its state, its public API (any thread), and the iteration loop.

One thread owns all request state; other threads talk to it through `submit`/`abort`
(the pool's inbox) and read results from `RequestStream`s. Each iteration is one target
forward, and `Engine._iterate` reads as the papers' loop, one phase per module:

    admission.intake -> planner.form_step -> drafting.speculate -> prepare.verify_batch
        -> target.forward -> output.commit -> telemetry.observe_iteration

The drafter, the scheduler and the target are interfaces (adaserve/drafter.py,
adaserve/scheduler.py, adaserve/target.py): in-process or gRPC, real or modelled (the
simulator runs this same code). The drafter and the scheduler are wrapped once here
(adaserve/fallback.py), so a failing drafter degrades to plain decoding and a failing
scheduler to in-process selection without a branch in the step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, replace

from adaserve import cpu_load, metrics
from adaserve.adaptive import AcceptanceEstimate, SLOFloor, plan_depth_width, slo_floor
from adaserve.calibration import Baseline, Remeasure, RetrySchedule, remeasured
from adaserve.config import Settings
from adaserve.detokenize import Tokenizer
from adaserve.drafter import Drafter
from adaserve.engine import admission, drafting, output, planner, prepare, recovery, telemetry
from adaserve.engine.contracts import IterationReport, IterationTiming
from adaserve.engine.estimates import Costs, TSpecPredictor
from adaserve.engine.lifecycle import finish
from adaserve.engine.state import Request, RequestPool
from adaserve.fallback import FallbackDrafter, FallbackScheduler
from adaserve.grammar import GrammarBackend
from adaserve.isolation import Quarantine
from adaserve.latency import Curve, ForwardLatency
from adaserve.methods import SOURCES, USES_EAGLE, USES_MODEL, SourceStats, available_methods
from adaserve.request import GenerationRequest
from adaserve.routing import UnitLoad
from adaserve.scheduler import LocalScheduler, Scheduler
from adaserve.stream import RequestStream
from adaserve.target import TargetModel

log = logging.getLogger("adaserve.engine")

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
        self.pool = RequestPool()
        self.local_scheduler = LocalScheduler(settings.scheduler)
        self.scheduler = FallbackScheduler(
            scheduler, self.local_scheduler, settings.scheduler.remote_select
        )
        self.drafter = self.wrap_drafter(drafter, self.draft_history)
        self.ngram = self.wrap_drafter(ngram, self.history)
        self._wire_drafter(drafter)
        self.method_stats = {source: SourceStats() for source in SOURCES}
        # Per level, where it proposes: whether verifying its trees pays under load.
        self.ngram_acceptance = AcceptanceEstimate(settings.speculation.ngram.acceptance)
        adaptive = settings.scheduler.adaptive
        self.acceptance = (
            AcceptanceEstimate(adaptive.acceptance) if adaptive.learn_acceptance else None
        )
        # The longest sequence the KV cache can hold beside one tree of scratch: a
        # request is never admitted that could not run alone.
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
        self.tspec = TSpecPredictor(base_ms, settings.scheduler.correction_factor)
        if latency is None:
            curve = settings.engine.latency_curve
            latency = ForwardLatency(
                Curve(tuple(curve.tokens), tuple(curve.ms), curve.context_ms)
                if curve is not None
                else Curve.knee(base_ms, settings.scheduler.budget)
            )
        self.latency = latency
        self.costs = Costs()
        # The last iteration's prompts needed more prefill than it carried (BatchPlan):
        # the prompt hold then admits (a held prompt would join a late queue).
        self.ttft_short = False
        # Prompt tokens the last iteration carried (planner.riding_prefill).
        self.last_prefill_tokens = 0
        self.recompute: set[str] = set()  # requests whose features the target recomputes
        self._floor: SLOFloor | None = None  # the floor every report reads (slo_floor)
        self.iterations = 0
        self.optimal_invalid_logged = False
        self.preemptions = 0  # requests preempted so far (the metric counts them too)
        self._thread: threading.Thread | None = None
        self._loop_done: Future | None = None
        self._stop = threading.Event()
        self._draining = False
        # The loop stamps this every pass (idle or not): its age is how long the loop
        # has made no progress, which liveness checks read (a wedged forward).
        self._beat: float | None = None
        # Failure isolation (adaserve/isolation.py): the suspects of failed iterations,
        # and the requests the iteration in progress carries (None: not decided yet).
        self.quarantine = Quarantine()
        self.carrying: list[Request] | None = None

    def wrap_drafter(
        self, drafter: Drafter | None, history: Callable[[str], list[int]]
    ) -> FallbackDrafter | None:
        """`drafter` as this engine runs it: behind the fallback that re-syncs it from
        `history` and degrades to plain decoding while it fails (None where this
        engine does not speculate). A drafter swapped into `self.drafter` needs it."""
        if drafter is None or not self.settings.engine.speculation:
            return None
        # The clock through a lambda: the engine's may be replaced after construction.
        return FallbackDrafter(drafter, history, self.target.vocab_size, clock=lambda: self.clock())

    def _wire_drafter(self, drafter: Drafter | None) -> None:
        """The unit's drafter is a draft model or an EAGLE head (its `kind`): the head
        reads the target's features, which the target then returns (adaserve/
        features.py), and the requests whose method may use it keep them."""
        self.drafter_kind = str(getattr(drafter, "kind", "model"))
        self.uses_drafter = USES_EAGLE if self.drafter_kind == "eagle" else USES_MODEL
        eagle = self.drafter is not None and self.drafter_kind == "eagle"
        self.feature_dim = 0
        if eagle:
            spec = drafter.spec  # type: ignore[union-attr]
            self.target.return_features(  # type: ignore[attr-defined]
                spec.feature_layers, spec.target_layers, spec.hidden_size
            )
            self.feature_dim = int(spec.feature_dim)
        self.methods = available_methods(
            self.drafter is not None and not eagle, self.ngram is not None, eagle
        )
        # A default or an SLO class naming eagle on a unit without an EAGLE drafter
        # would refuse every request it covers: refused here, at startup, instead
        # (the other methods keep their per-request answer).
        settings = self.settings
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

    # ---- public API (any thread) ---------------------------------------------------

    def submit(self, req: GenerationRequest) -> RequestStream:
        if self._draining:
            raise EngineDraining("this serving unit is draining: send the request elsewhere")
        admission.validate(self, req)
        if self.pool.inbox.qsize() + len(self.pool.waiting) >= self.settings.engine.max_queue:
            raise EngineFull("server is at capacity: too many queued requests")
        verdict = admission.judge(self, req)
        if verdict.best_effort and self.settings.engine.unattainable_slo == "reject":
            raise SLOUnattainable(verdict.reason)
        self.pool.claim(req.id)
        stream = RequestStream(req.id, verdict)
        self.pool.put(("submit", (req, stream, self.clock())))
        return stream

    def abort(self, request_id: str) -> None:
        self.pool.put(("abort", request_id))

    def stats(self) -> EngineStats:
        running = list(self.pool.running.values())
        return EngineStats(
            running=len(running),
            waiting=len(self.pool.waiting),
            tracked=len(running) + len(self.pool.waiting),
            kv_usage=self.target.kv_usage(),
            iterations=self.iterations,
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

    @property
    def loop_alive(self) -> bool:
        """Whether the loop started by `start` is still running."""
        if self._thread is not None:
            return self._thread.is_alive()
        return self._loop_done is not None and not self._loop_done.done()

    def load(self) -> UnitLoad:
        """This unit's load as routers read it (adaserve/routing.py): occupancy, the
        predicted TPOT at each batch size up to max_running, the tightest SLO it holds
        and its prefill queue. Safe from any thread; cheap enough for every request."""
        running = list(self.pool.running.values())
        waiting = list(self.pool.waiting)
        held = [r.req.tpot_slo_ms for r in [*running, *waiting] if not r.best_effort]
        max_running = self.settings.engine.max_running
        sizes = sorted({*(1 << i for i in range(max_running.bit_length())), max_running})
        n = self.settings.engine.max_batch_tokens
        load = UnitLoad(
            running=len(running),
            waiting=len(waiting) + self.pool.inbox.qsize(),
            max_running=max_running,
            kv_usage=self.target.kv_usage(),
            tpot_curve=tuple((b, self.predicted_tpot_ms(b)) for b in sizes),
            tightest_slo_ms=min(held, default=0.0),
            prefill_queue_tokens=sum(left for _, left, _ in self.pool.prefill_queue),
            prefill_ms_per_token=planner.iteration_ms(self, 0, n) / n,
            draining=self._draining,
        )
        telemetry.export_load(self, load, running)
        return load

    def predicted_tpot_ms(self, n: int) -> float:
        """TPOT of a request in a decode batch of n: the model's (`modelled_tpot_ms`)
        times how far what requests here actually waited per token lately is from the
        model at the batch size they ran at (prefill chunks riding along, host work,
        acceptance unlike the setting's: all in the measurement)."""
        model = self.modelled_tpot_ms(n)
        if self.costs.tpot_seen is None:
            return model
        seen_ms, seen_batch = self.costs.tpot_seen
        at = self.modelled_tpot_ms(max(round(seen_batch), 1))
        return model * min(max(seen_ms / at, 0.5), 4.0) if at > 0 else model

    def modelled_tpot_ms(self, n: int) -> float:
        """TPOT of a request in a decode batch of n by the model alone: the plan's
        iteration (tree tokens on the latency model, plus the draft phase it measured)
        over the tokens a request gets per iteration (the bonus plus each chain level
        with probability alpha^j; fewer levels where the budget runs out)."""
        budget = self.settings.scheduler.budget
        a = planner.adaptive_settings(self)
        depth, width = plan_depth_width(n, budget, a) if self.drafter is not None else (0, 1)
        tokens = min(max(budget, n), n * (1 + depth * width))
        ms = self.latency.predict_ms(tokens) + (self.costs.draft_ms if depth else 0.0)
        levels = min(depth, max(tokens // max(n, 1) - 1, 0))
        return ms / sum(a.acceptance**j for j in range(levels + 1))

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
        a = planner.adaptive_settings(self)
        depth_max = 0
        if self.drafter is not None:
            depth_max = a.fixed_depth if a.policy == "fixed" else a.d_max
        fresh = slo_floor(self.tspec.predict_ms(1), self.settings.scheduler.budget, a, depth_max)
        held = self._floor
        if held is None or abs(fresh.tpot_ms - held.tpot_ms) > FLOOR_HYSTERESIS * held.tpot_ms:
            # 0.001 ms: the precision every report prints, so they print the same number.
            self._floor = held = replace(fresh, tpot_ms=round(fresh.tpot_ms, 3))
        return held

    def history(self, request_id: str) -> list[int]:
        """A running request's committed tokens (the n-gram drafter's re-sync reads
        them)."""
        return self.pool.running[request_id].tokens

    def draft_history(self, request_id: str) -> list[int]:
        """The same as the draft model reads them (its re-sync): from draft_start."""
        r = self.pool.running[request_id]
        return r.tokens[r.draft_start :]

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
        self.pool.wake.set()
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
                self.pool.wake.wait(timeout=0.05)
                self.pool.wake.clear()
                self._recalibrate()
            try:
                self.step()
            except Exception:  # failure isolation itself failed: fail the batch, go on
                log.exception("engine iteration failed; failing the running requests")
                for r in list(self.pool.running.values()):
                    finish(self, r, "error", error="internal error in the engine iteration")

    def has_work(self) -> bool:
        return self.pool.has_work()

    def step(self) -> IterationReport | None:
        """One iteration: intake, then one forward carrying the trees of the decoding
        requests and the prefill chunks that fit beside them. A failure ends only the
        requests it concerns (adaserve/isolation.py). None: no forward ran."""
        self.carrying = None
        try:
            return self._iterate()
        except Exception as exc:
            recovery.iteration_failed(self, exc)
            return None

    def _iterate(self) -> IterationReport | None:
        start = self.clock()
        if not admission.intake(self):  # nothing is running: no forward
            return None
        planned = self.clock()
        plan = planner.form_step(self)
        proposals = drafting.speculate(self, plan)
        drafted = self.clock()
        batch = prepare.verify_batch(self, plan, proposals)
        prepared = self.clock()
        result = self.target.forward(batch.items, batch.chunks)
        timing = IterationTiming(start, planned, drafted, prepared, self.clock())
        output.commit(self, batch, result, timing)
        telemetry.observe_iteration(self, batch, timing)
        return IterationReport.of(batch, timing)

    # ---- the baseline ----------------------------------------------------------------

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
        self.tspec = TSpecPredictor(self.baseline.tpot_ms, self.tspec.correction)
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
