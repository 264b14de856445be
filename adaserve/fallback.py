"""Wrappers that keep the engine serving when the drafter or the scheduler fails.

`FallbackDrafter` and `FallbackScheduler` implement the same protocols as what they
wrap, so the engine's step calls them like any drafter or scheduler and never branches
on failures. A failing drafter degrades to plain decoding (root-only trees) and is
retried after a pause; a failing scheduler is replaced by in-process selection until a
probe finds it back. Answers from another process are checked (adaserve/checks.py)
and a bad one counts as a failure; neither ever fails a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from adaserve import metrics
from adaserve.checks import check_selection, check_trees
from adaserve.config import RemoteSelect
from adaserve.drafter import Drafter, DrafterStateLost, DraftUpdate
from adaserve.latency import ewma
from adaserve.scheduler import LocalScheduler, Scheduler
from adaserve.selection import RequestProgress, Selection, SelectionParams
from adaserve.tree import CandidateTree, TreeBatch

log = logging.getLogger("adaserve.engine")

RETRY_S = 1.0  # a failed drafter is not asked again sooner: no timeout every iteration
# Selections between measurements of the scheduler not in use (remote_select auto), and
# the weight of each new wait in a side's moving average.
PROBE_EVERY = 64
MS_ALPHA = 0.2
SIDES = ("remote", "local")
MAX_QUEUED_RELEASES = 100_000  # ids, a few MB at most


class FallbackDrafter:
    """A drafter that never raises: failures give root-only trees (plain decoding).

    `history(id)` is the request's committed tokens: after `DrafterStateLost` (a
    restarted drafter) the lost requests are re-sent from it in full. `ok` says
    whether the last `speculate` reached the drafter (the engine then knows the drafter
    holds the tokens it sent). Releases are queued and sent by `flush`, once per
    iteration, and never while the drafter is down (a hung drafter would otherwise cost
    a timeout per finishing request).

    An EAGLE drafter's lost requests cannot be re-sent from their tokens (their old
    features are gone): they get root-only trees, the others are drafted, and `lost`
    names them for the engine, which has the verifier recompute their features."""

    def __init__(
        self,
        drafter: Drafter,
        history: Callable[[str], Sequence[int]],
        vocab_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = drafter
        self.history = history
        self.vocab_size = vocab_size
        self.clock = clock
        self.healthy = True
        self.ok = False
        self.lost: list[str] = []  # the last call's lost ids it could not re-send
        self._resend = getattr(drafter, "kind", "model") != "eagle"
        self._retry_at = 0.0
        self._releases: list[str] = []
        # Our own beam search's trees are not re-validated on the hot path (select()
        # checks the structure of whatever it is given anyway); another process's are.
        self._trusted = bool(getattr(drafter, "trusted", False))

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        roots = [CandidateTree.root_only(int(self.history(u.id)[u.total_len - 1])) for u in updates]
        self.ok = False
        self.lost = []
        if not updates:
            return roots
        if not self.healthy and self.clock() < self._retry_at:
            metrics.fallbacks_total.labels("drafter").inc()
            return roots
        try:
            try:
                trees = self.inner.speculate(updates, depth, width, stop_prob)
            except DrafterStateLost as lost:
                # Re-sync those requests from their full history; the rest are unchanged.
                ids = set(lost.ids)
                if not self._resend:
                    return self._without(updates, ids, roots, depth, width, stop_prob)
                metrics.drafter_resyncs_total.inc(len(lost.ids))
                updates = [
                    DraftUpdate(
                        u.id,
                        np.asarray(self.history(u.id)[: u.total_len], np.int32),
                        u.total_len,
                        u.ingest,
                    )
                    if u.id in ids
                    else u
                    for u in updates
                ]
                trees = self.inner.speculate(updates, depth, width, stop_prob)
            if not self._trusted:
                check_trees(trees, [int(t.tokens[0]) for t in roots], self.vocab_size)
        except Exception as exc:
            self._failed(exc)
            return roots
        self.ok = True
        if not self.healthy:
            log.info("drafter recovered; speculation resumes")
            self.healthy = True
        return trees

    def _without(
        self,
        updates: list[DraftUpdate],
        lost: set[str],
        roots: list[CandidateTree],
        depth: int,
        width: int,
        stop_prob: float,
    ) -> list[CandidateTree]:
        """The trees of the updates not in `lost` (drafted again without them; the
        drafter changed no state in the failed call); root-only for the lost."""
        keep = [i for i, u in enumerate(updates) if u.id not in lost]
        trees = list(roots)
        if keep:
            got = self.inner.speculate([updates[i] for i in keep], depth, width, stop_prob)
            if not self._trusted:
                check_trees(got, [int(roots[i].tokens[0]) for i in keep], self.vocab_size)
            for i, t in zip(keep, got, strict=True):
                trees[i] = t
        self.lost = sorted(lost)
        self.ok = True
        self.healthy = True
        return trees

    def release(self, ids: list[str]) -> None:
        self._releases.extend(ids)

    def flush(self) -> None:
        if not self._releases or (not self.healthy and self.clock() < self._retry_at):
            return
        ids, self._releases = self._releases, []
        try:
            self.inner.release(ids)
        except Exception as exc:  # never fail on this
            # Kept for the next flush: a drafter that timed out still holds the state (a
            # restarted one ignores ids it does not know). Bounded, should it never return.
            self._releases = [*ids, *self._releases][-MAX_QUEUED_RELEASES:]
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        metrics.fallbacks_total.labels("drafter").inc()
        if self.healthy:
            log.warning("drafter unavailable (%s); plain decoding until it returns", exc)
        self.healthy = False
        self._retry_at = self.clock() + RETRY_S


class FallbackScheduler:
    """A scheduler that never raises: failures select in-process, and a background
    probe (`plan(1)` once a second) brings the remote one back.

    With `remote_select="auto"` a remote scheduler answers only while it is the faster
    way: the engine waits for a Select wherever it runs, so the call's transport is
    iteration time unless the remote compute saves more. The time of each side is a
    moving average of what the engine waited for it; the side not in use is measured
    again every PROBE_EVERY selections, so a change in either shows."""

    def __init__(
        self, scheduler: Scheduler, local: LocalScheduler, remote_select: RemoteSelect
    ) -> None:
        self.inner = scheduler
        self.local = local
        self.healthy = True
        self._remote = not isinstance(scheduler, LocalScheduler)
        self._always = remote_select == "always"
        self._stopped = threading.Event()
        self._ms: dict[str, float] = {}  # "remote" / "local" -> moving average wait
        self._counted = {side: metrics.selections_total.labels(side) for side in SIDES}
        self._calls = 0

    def plan(self, n: int) -> tuple[int, int]:
        return self.local.plan(n)

    def select(
        self,
        requests: Sequence[RequestProgress],
        trees: Sequence[CandidateTree] | TreeBatch,
        params: SelectionParams,
    ) -> Selection:
        if not self._remote:
            return self.inner.select(requests, trees, params)
        if self.healthy and self._use_remote():
            t0 = time.perf_counter()
            try:
                selection = self.inner.select(requests, trees, params)
                # Answers from another process are checked; our own selection is not
                # re-validated on the hot path (it is tested against a reference).
                if not selection.invalid:  # invalid: no nodes to check
                    given = trees.trees() if isinstance(trees, TreeBatch) else trees
                    check_selection(selection.selected, given)
                self._observe("remote", t0)
                return selection
            except Exception as exc:
                self._failed(exc)
        t0 = time.perf_counter()
        selection = self.local.select(requests, trees, params)
        if self.healthy:
            self._observe("local", t0)
        return selection

    @property
    def remote_in_use(self) -> bool:
        """Whether Selects go to the remote scheduler now (probes aside)."""
        return self._remote and self.healthy and self._prefers_remote()

    def _prefers_remote(self) -> bool:
        return self._always or len(self._ms) < 2 or self._ms["remote"] <= self._ms["local"]

    def _use_remote(self) -> bool:
        if self._always:
            return True
        if len(self._ms) < 2:  # each side measured once, the remote first
            return "remote" not in self._ms
        self._calls += 1
        return self._prefers_remote() != (self._calls % PROBE_EVERY == 0)  # now and then the other

    def _observe(self, side: str, t0: float) -> None:
        ms = (time.perf_counter() - t0) * 1000.0
        self._ms[side] = ewma(self._ms.get(side, ms), ms, MS_ALPHA)
        self._counted[side].inc()

    def stop(self) -> None:
        self._stopped.set()

    def _failed(self, exc: Exception) -> None:
        metrics.fallbacks_total.labels("scheduler").inc()
        if self.healthy:
            log.warning("scheduler unavailable (%s); selecting in-process", exc)
            self.healthy = False
            threading.Timer(1.0, self._probe).start()

    def _probe(self) -> None:
        try:
            self.inner.plan(1)
        except Exception:
            if not self._stopped.is_set():
                threading.Timer(1.0, self._probe).start()
            return
        log.info("scheduler recovered")
        self.healthy = True
