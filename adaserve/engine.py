"""The serving engine: request pool, admission, and the speculative iteration loop.

One thread owns all request state; other threads talk to it through `submit`/`abort`
(queues) and read results from `RequestStream`s. Each iteration reads like the paper:

    plan (d, w) -> speculate -> select -> verify -> apply (stream, retire)

The drafter and the scheduler are interfaces with in-process and gRPC implementations;
the target is an interface so the simulator can substitute a modelled one. Failure of
the drafter degrades to plain decoding (root-only trees), failure of the scheduler to
in-process selection: neither ever fails a request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from adaserve import metrics
from adaserve.adaptive import AcceptanceEstimate, SLOFloor, plan_depth_width, slack_plan, slo_floor
from adaserve.checks import check_selection, check_trees
from adaserve.config import AdaptiveSettings, Settings
from adaserve.detokenize import IncrementalDetokenizer, Tokenizer
from adaserve.request import GenerationRequest, TokenDelta
from adaserve.sampling import TokenRng
from adaserve.scheduler import LocalScheduler, Scheduler, selection_params
from adaserve.selection import RequestProgress, Selection, SelectionParams
from adaserve.slo import SLOVerdict, judge, required_accepted
from adaserve.speculate import BeamDrafter, Drafter, DrafterStateLost, DraftUpdate
from adaserve.target import TargetModel, VerifyItem
from adaserve.tree import CandidateTree

log = logging.getLogger("adaserve.engine")


class EngineFull(RuntimeError):
    """The waiting queue is full: callers answer 429 / RESOURCE_EXHAUSTED."""


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


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    tracked: int  # requests holding any engine state (running + waiting + finishing)
    kv_usage: float
    iterations: int
    drafter_healthy: bool
    scheduler_healthy: bool


class RequestStream:
    """Deltas of one request, produced by the engine thread, consumed by one reader
    (blocking `get` or `async for ... in stream.aiter()`). `verdict` is admission's
    judgement of the request's SLO, known from submit on."""

    def __init__(self, request_id: str, verdict: SLOVerdict) -> None:
        self.request_id = request_id
        self.verdict = verdict
        self._q: queue.SimpleQueue[TokenDelta] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None

    def put(self, delta: TokenDelta) -> None:
        self._q.put(delta)
        if self._loop is not None and self._wakeup is not None:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def get(self, timeout: float | None = None) -> TokenDelta | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    async def aiter(self) -> AsyncIterator[TokenDelta]:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        while True:
            self._wakeup.clear()
            while True:  # drain before waiting: deltas may predate the event
                try:
                    delta = self._q.get_nowait()
                except queue.Empty:
                    break
                yield delta
                if delta.finish_reason is not None:
                    return
            await self._wakeup.wait()


@dataclass
class _Request:
    """Engine-side mutable state of one request; touched only by the loop thread."""

    req: GenerationRequest
    stream: RequestStream
    arrival: float
    tokens: list[int]  # prompt + generated, all committed
    detok: IncrementalDetokenizer | None
    generator: TokenRng | None
    best_effort: bool = False
    first_token_t: float | None = None
    last_token_t: float | None = None
    drafter_len: int = 0  # tokens the drafter holds as committed
    reserved_tokens: int = 0
    finished: bool = False

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def deadline(self) -> float | None:
        t = self.req.timeout_s
        return None if t is None else self.arrival + t


@dataclass
class _TSpecPredictor:
    """Predicts the next iteration's latency: an EWMA of measured iterations per token
    count, seeded from the profile and inflated by the correction factor."""

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
    ) -> None:
        if settings.slo.baseline_tpot_ms == "auto":
            raise ValueError(
                "slo.baseline_tpot_ms 'auto' must be measured first (build_engine does)"
            )
        self.baseline_tpot_ms: float = settings.slo.baseline_tpot_ms  # measured: not "auto"
        self.target = target
        self.drafter = drafter if settings.engine.speculation else None
        self.scheduler = scheduler
        self.local_scheduler = LocalScheduler(settings.scheduler)
        adaptive = settings.scheduler.adaptive
        self.acceptance = (
            AcceptanceEstimate(adaptive.acceptance) if adaptive.learn_acceptance else None
        )
        self.settings = settings
        self.tokenizer = tokenizer
        self.clock = clock
        self.model_name = model_name
        self.max_model_len = min(
            target.max_model_len, settings.engine.max_model_len or target.max_model_len
        )
        self.tspec = _TSpecPredictor(self.baseline_tpot_ms, settings.scheduler.correction_factor)

        self._inbox: queue.SimpleQueue[_InboxItem] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._reserved = 0
        self._iterations = 0
        self._arrivals = itertools.count()
        # Ids of submitted, not yet retired requests: a second request under a live id
        # would share the first one's KV sequence and fail the whole batch.
        self._live_ids: set[str] = set()
        self._live_lock = threading.Lock()
        self._drafter_healthy = True
        self._scheduler_healthy = True
        self._optimal_invalid_logged = False
        self._drafter_retry_at = 0.0
        # Retired requests whose draft state is still to be freed: one Release per
        # iteration, and none while the drafter is down (a hung drafter would otherwise
        # cost a timeout per finishing request).
        self._release_backlog: list[str] = []
        self._thread: threading.Thread | None = None
        self._loop_done: Future | None = None
        self._stop = threading.Event()

    # ---- public API (any thread) ---------------------------------------------------

    def submit(self, req: GenerationRequest) -> RequestStream:
        self._validate(req)
        if self._inbox.qsize() + len(self._waiting) >= self.settings.engine.max_queue:
            raise EngineFull("server is at capacity: too many queued requests")
        floor = self.slo_floor()
        verdict = judge(req.tpot_slo_ms, floor.tpot_ms, floor.depth)
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
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            tracked=len(self._running) + len(self._waiting),
            kv_usage=self.target.kv_usage(),
            iterations=self._iterations,
            drafter_healthy=self._drafter_healthy,
            scheduler_healthy=self._scheduler_healthy,
        )

    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.model_name,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(self.target.eos_token_ids),
            baseline_tpot_ms=self.baseline_tpot_ms,
            speculative=self.drafter is not None,
            slo_floor_ms=self.slo_floor().tpot_ms,
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
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._loop_done is not None:
            wait([self._loop_done], timeout=30)

    # ---- the loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.has_work():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
            try:
                self.step()
            except Exception:  # a bug must not wedge every client: fail the batch, go on
                log.exception("engine iteration failed; failing the running requests")
                for r in list(self._running.values()):
                    self._finish(r, "error", error="internal error in the engine iteration")

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or not self._inbox.empty())

    def step(self) -> None:
        """One iteration: intake, admission + prefill, then one speculative decode step."""
        start = self.clock()
        self._drain_inbox()
        self._expire_deadlines()
        prefill_s = self._admit()
        if not self._running:
            self._flush_releases()
            return
        t0 = self.clock()
        batch = list(self._running.values())
        drafted, depth, width = self._plan(batch)
        trees = self._speculate(batch, drafted, depth, width)
        t1 = self.clock()
        selected = self._select(batch, trees, depth)
        t2 = self.clock()
        results = self.target.verify(
            [
                VerifyItem(
                    r.req.id,
                    tree,
                    r.req.sampling,
                    r.generator,
                    r.req.sampling.max_tokens - r.num_generated,
                )
                for r, tree in zip(batch, selected, strict=True)
            ]
        )
        t3 = self.clock()
        for r, tree, res in zip(batch, selected, results, strict=True):
            self._record_spec(tree, res.accepted_nodes, len(res.emitted_tokens))
            self._apply(r, res.emitted_tokens.tolist(), t3)
        self._observe_iteration(batch, selected, t0, t1, t2, t3)
        self._flush_releases()
        # The rest of the step (intake, admission bookkeeping, stop checks, detokenizing,
        # streaming): host time every running request waits, outside the model phases.
        host = self.clock() - start - (t3 - t0) - prefill_s
        metrics.iteration_seconds.labels("host").observe(max(host, 0.0))

    # ---- iteration phases ----------------------------------------------------------

    def _plan(self, batch: list[_Request]) -> tuple[list[_Request], int, int]:
        """(requests to draft for, depth, width). d and w are a pure function of n and
        the settings this process already holds: planning locally saves one of the three
        round trips of a gRPC iteration (the scheduler service keeps `Plan` for others)."""
        if self.drafter is None:
            return [], 0, 1
        budget, adaptive = self.settings.scheduler.budget, self._adaptive()
        # Plan for the batch the next iteration runs: requests that arrived during this
        # step join it then. Otherwise the first request of a burst drafts deep alone
        # (and the drafter prefills its prompt) while the rest wait to be admitted. An
        # abort queued there counts too: an overestimate for one iteration at most.
        arriving = self._inbox.qsize()
        n = min(len(batch) + arriving, self.settings.engine.max_running)
        depth, width = plan_depth_width(n, budget, adaptive)
        if depth > 0:
            return batch, depth, width
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
        drafted = [r for r, b, t in zip(batch, behind, tight, strict=True) if b or t]
        if not drafted:
            return [], 0, width
        depth, width = plan_depth_width(len(drafted), budget, adaptive)
        return drafted, slack_depth or depth, width

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

    def _progress(self, batch: list[_Request]) -> list[RequestProgress]:
        now = self.clock()
        return [
            RequestProgress(
                id=r.req.id,
                tpot_slo_ms=r.req.tpot_slo_ms,
                elapsed_ms=(now - r.first_token_t) * 1000.0 if r.first_token_t else 0.0,
                decoded=max(r.num_generated - 1, 0),
            )
            for r in batch
        ]

    def _speculate(
        self, batch: list[_Request], drafted: list[_Request], depth: int, width: int
    ) -> list[CandidateTree]:
        """Trees for `batch`: beam-searched for the requests in `drafted`, root-only for
        the rest (the drafter catches up on their tokens the next time it sees them)."""
        roots = [CandidateTree.root_only(r.tokens[-1]) for r in batch]
        drafter = self.drafter
        if drafter is None or not drafted or depth == 0:
            return roots
        now = self.clock()
        if not self._drafter_healthy and now < self._drafter_retry_at:
            metrics.fallbacks_total.labels("drafter").inc()
            return roots
        updates = [
            DraftUpdate(r.req.id, np.asarray(r.tokens[r.drafter_len :], np.int32), len(r.tokens))
            for r in drafted
        ]
        stop = self.settings.scheduler.adaptive.draft_stop_prob or 0.0
        try:
            try:
                trees = drafter.speculate(updates, depth, width, stop)
            except DrafterStateLost as lost:
                # Re-sync those requests from their full history; the rest are unchanged.
                metrics.drafter_resyncs_total.inc(len(lost.ids))
                ids = set(lost.ids)
                updates = [
                    DraftUpdate(u.id, np.asarray(r.tokens, np.int32), len(r.tokens))
                    if u.id in ids
                    else u
                    for u, r in zip(updates, drafted, strict=True)
                ]
                trees = drafter.speculate(updates, depth, width, stop)
            # As with selections: another process's trees are checked, our own beam
            # search's are not re-validated on the hot path (select() validates the
            # structure of whatever it is given anyway).
            if not isinstance(self.drafter, BeamDrafter):
                check_trees(trees, [r.tokens[-1] for r in drafted], self.target.vocab_size)
        except Exception as exc:
            self._drafter_failed(exc)
            return roots
        for r in drafted:
            r.drafter_len = len(r.tokens)
        if not self._drafter_healthy:
            log.info("drafter recovered; speculation resumes")
            self._drafter_healthy = True
        if len(drafted) == len(batch):
            return trees
        by_id = {r.req.id: t for r, t in zip(drafted, trees, strict=True)}
        return [by_id.get(r.req.id, root) for r, root in zip(batch, roots, strict=True)]

    def _select(
        self, batch: list[_Request], trees: list[CandidateTree], depth: int
    ) -> list[CandidateTree]:
        if all(len(t) == 1 for t in trees):
            return trees
        progress = self._progress(batch)
        sched = self.settings.scheduler
        t_spec_ms = self.tspec.measured_ms(max(sched.budget, len(batch)))
        params = selection_params(sched, depth, t_spec_ms, len(batch))
        selection = None
        if self._scheduler_healthy:
            try:
                selection = self.scheduler.select(progress, trees, params)
                # Answers from another process are checked; our own selection is not
                # re-validated on the hot path (it is tested against a reference).
                if not isinstance(self.scheduler, LocalScheduler) and not selection.invalid:
                    check_selection(selection.selected, trees)
            except Exception as exc:
                selection = None
                self._scheduler_failed(exc)
        if selection is None:
            selection = self.local_scheduler.select(progress, trees, params)
        if selection.invalid:
            selection = self._optimal_invalid(progress, trees, params)
        return [t.subtree(idx) for t, idx in zip(trees, selection.selected, strict=True)]

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

    def _apply(self, r: _Request, emitted: list[int], now: float) -> None:
        """Commit emitted tokens to the request: stop checks, detokenize, stream."""
        if r.finished:
            return
        sp = r.req.sampling
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(self.target.eos_token_ids)
        finish: str | None = None
        kept: list[int] = []
        for tok in emitted:
            kept.append(tok)
            if tok in stops:
                finish = "stop"
                break
            if r.num_generated + len(kept) >= sp.max_tokens:
                finish = "length"
                break
        r.tokens.extend(kept)
        if r.first_token_t is None and kept:
            r.first_token_t = now
        if kept:
            r.last_token_t = now
        text = ""
        if r.detok is not None:
            # eos/stop ids are special tokens: skip_special_tokens keeps them out of text.
            text, hit_stop = r.detok.add(kept)
            if hit_stop:
                finish = "stop"
            elif finish is not None:
                text += r.detok.flush()
        if len(r.tokens) + 1 >= self.max_model_len and finish is None:
            finish = "length"
            if r.detok is not None:
                text += r.detok.flush()
        ttft = (
            (r.first_token_t - r.arrival) * 1000.0
            if r.first_token_t is not None and r.num_generated == len(kept) and kept
            else None
        )
        r.stream.put(
            TokenDelta(
                token_ids=tuple(kept),
                text=text,
                finish_reason=finish,
                num_prompt_tokens=r.num_prompt,
                num_generated=r.num_generated,
                ttft_ms=ttft,
                best_effort=r.best_effort,
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
        if len(req.prompt_token_ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({sp.max_tokens}) "
                f"exceeds the model's context length ({self.max_model_len})"
            )
        vocab = self.target.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if sp.temperature < 0 or not (0 < sp.top_p <= 1) or sp.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 are required")

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "submit":
                req, stream, arrival = item[1]
                self._waiting.append(self._new_request(req, stream, arrival))
            else:
                self._abort(item[1])

    def _new_request(
        self, req: GenerationRequest, stream: RequestStream, arrival: float
    ) -> _Request:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, stop=tuple(req.sampling.stop))
        return _Request(
            req=req,
            stream=stream,
            arrival=arrival,
            tokens=list(req.prompt_token_ids),
            detok=detok,
            generator=self.target.make_generator(req.sampling.seed),
        )

    def _admit(self) -> float:
        """Admit what fits and prefill it; returns the prefill's seconds."""
        if not self._waiting:
            return 0.0
        # vLLM-style priority: lower value first, then arrival order.
        self._waiting.sort(key=lambda r: (r.req.priority, r.arrival))
        max_tree = self._max_tree_nodes()
        admitted: list[_Request] = []
        while (
            self._waiting and len(self._running) + len(admitted) < self.settings.engine.max_running
        ):
            r = self._waiting[0]
            # Reserve the request's whole KV up front (prompt + output + one tree of
            # scratch): a running request can then never hit an exhausted cache.
            need = r.num_prompt + r.req.sampling.max_tokens + max_tree
            if not self.target.can_reserve(self._reserved + need):
                if not self._running and not admitted:
                    self._waiting.pop(0)
                    self._finish(r, "error", error="request does not fit in the KV cache")
                    continue
                break
            self._waiting.pop(0)
            r.reserved_tokens = need
            self._reserved += need
            admitted.append(r)
        if not admitted:
            return 0.0
        t0 = self.clock()
        first = self.target.prefill(
            [(r.req.id, r.tokens, r.req.sampling, r.generator) for r in admitted]
        )
        now = self.clock()
        # Prefill blocks decoding: its time is part of what every running request waits.
        metrics.iteration_seconds.labels("prefill").observe(now - t0)
        for r, tok in zip(admitted, first, strict=True):
            self._running[r.req.id] = r
            r.best_effort = self._judge_best_effort(r)
            self._apply(r, [tok], now)
        metrics.num_running.set(len(self._running))
        metrics.num_waiting.set(len(self._waiting))
        return now - t0

    def slo_floor(self) -> SLOFloor:
        """The best TPOT one request alone can expect now (adaptive.slo_floor), from the
        predicted 1-token iteration and the plan's cost model and acceptance (learned,
        where it is). Read from any thread: submit judges each SLO with it."""
        a = self._adaptive()
        depth_max = 0
        if self.drafter is not None:
            depth_max = a.fixed_depth if a.policy == "fixed" else a.d_max
        return slo_floor(self.tspec.predict_ms(1), self.settings.scheduler.budget, a, depth_max)

    def _judge_best_effort(self, r: _Request) -> bool:
        """An unattainable SLO (judged at submit; policy `best_effort`, as `reject`
        refused it there) is served best-effort and flagged, not refused."""
        if r.stream.verdict.best_effort:
            metrics.best_effort_total.labels(r.req.slo_class or "custom").inc()
            return True
        return False

    def _max_tree_nodes(self) -> int:
        if self.drafter is None:
            return 1
        a = self.settings.scheduler.adaptive
        return 1 + a.d_max * a.w_max

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
        r.stream.put(
            TokenDelta(
                token_ids=(),
                text="",
                finish_reason=reason,
                num_prompt_tokens=r.num_prompt,
                num_generated=r.num_generated,
                best_effort=r.best_effort,
                error=error,
            )
        )
        self._retire(r, reason)

    def _retire(self, r: _Request, reason: str) -> None:
        r.finished = True
        with self._live_lock:
            self._live_ids.discard(r.req.id)
        if r in self._waiting:
            self._waiting.remove(r)
        if self._running.pop(r.req.id, None) is not None:
            self.target.free(r.req.id)
            self._reserved -= r.reserved_tokens
            if self.drafter is not None and r.drafter_len:
                self._release_backlog.append(r.req.id)
        self._record_finish(r, reason)
        metrics.num_running.set(len(self._running))
        metrics.num_waiting.set(len(self._waiting))

    def _flush_releases(self) -> None:
        if not self._release_backlog or self.drafter is None:
            return
        if not self._drafter_healthy and self.clock() < self._drafter_retry_at:
            return
        ids, self._release_backlog = self._release_backlog, []
        try:
            self.drafter.release(ids)
        except Exception as exc:  # a restarted drafter holds none of it; never fail on this
            self._drafter_failed(exc)

    # ---- failure handling (logged once per episode, counted every iteration) -------

    def _drafter_failed(self, exc: Exception) -> None:
        metrics.fallbacks_total.labels("drafter").inc()
        if self._drafter_healthy:
            log.warning("drafter unavailable (%s); plain decoding until it returns", exc)
        self._drafter_healthy = False
        self._drafter_retry_at = self.clock() + 1.0  # don't pay a timeout every iteration

    def _scheduler_failed(self, exc: Exception) -> None:
        metrics.fallbacks_total.labels("scheduler").inc()
        if self._scheduler_healthy:
            log.warning("scheduler unavailable (%s); selecting in-process", exc)
            self._scheduler_healthy = False
            threading.Timer(1.0, self._probe_scheduler).start()

    def _probe_scheduler(self) -> None:
        try:
            self.scheduler.plan(1)
        except Exception:
            if not self._stop.is_set():
                threading.Timer(1.0, self._probe_scheduler).start()
            return
        log.info("scheduler recovered")
        self._scheduler_healthy = True

    # ---- observability -------------------------------------------------------------

    def _record_spec(self, tree: CandidateTree, accepted_nodes, emitted: int) -> None:
        drafted = len(tree) - 1
        if drafted == 0:
            return
        accepted = len(accepted_nodes) - 1
        metrics.spec_num_drafts.inc()
        metrics.spec_emitted_tokens.inc(emitted)
        metrics.spec_num_draft_tokens.inc(drafted)
        metrics.spec_num_accepted_tokens.inc(accepted)
        for pos in range(accepted):
            metrics.spec_accepted_per_pos.labels(str(pos)).inc()
        if self.acceptance is not None:
            # The run of accepted levels ended in a rejection if the last accepted node
            # had children to choose from; at a leaf the tree just ended (censored).
            rejected = bool((tree.parents == accepted_nodes[-1]).any())
            self.acceptance.observe(accepted, rejected)
            metrics.spec_acceptance_estimate.set(self.acceptance.alpha)

    def _observe_iteration(self, batch, selected, t0, t1, t2, t3) -> None:
        tokens = sum(len(t) for t in selected)
        self._iterations += 1
        self.tspec.observe(tokens, (t3 - t0) * 1000.0)
        metrics.iterations_total.inc()
        metrics.iteration_seconds.labels("speculate").observe(t1 - t0)
        metrics.iteration_seconds.labels("select").observe(t2 - t1)
        metrics.iteration_seconds.labels("verify").observe(t3 - t2)
        metrics.iteration_seconds.labels("total").observe(t3 - t0)
        metrics.budget_used.observe(tokens)
        if self.acceptance is not None:
            self.acceptance.tick()
        metrics.batch_size.observe(len(batch))
        metrics.kv_usage.set(self.target.kv_usage())

    def _record_finish(self, r: _Request, reason: str) -> None:
        cls = r.req.slo_class or "custom"
        metrics.requests_total.labels(reason, cls).inc()
        if r.first_token_t is None:
            return
        metrics.ttft_seconds.labels(cls).observe(r.first_token_t - r.arrival)
        n = r.num_generated
        if n >= 2 and r.last_token_t is not None and reason in ("stop", "length"):
            tpot_ms = (r.last_token_t - r.first_token_t) * 1000.0 / (n - 1)
            metrics.tpot_seconds.labels(cls).observe(tpot_ms / 1000.0)
            if tpot_ms <= r.req.tpot_slo_ms:
                metrics.slo_attained_total.labels(cls).inc()
                metrics.goodput_tokens_total.labels(cls).inc(n)
            else:
                metrics.slo_missed_total.labels(cls).inc()
