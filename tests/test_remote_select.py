"""scheduler.remote_select (adaserve/fallback.py FallbackScheduler): with `auto` a
scheduler service answers only while it is the faster way to select, measured on both
sides and re-measured every PROBE_EVERY selections; `always` sends every Select to it.
Either way the answers are the same selection (the output never depends on where it
ran)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from adaserve import metrics
from adaserve.config import SchedulerSettings
from adaserve.fallback import PROBE_EVERY, FallbackScheduler
from adaserve.scheduler import LocalScheduler, Scheduler
from adaserve.selection import RequestProgress, Selection, SelectionParams
from adaserve.tree import CandidateTree, TreeBatch
from services.common.server import BackgroundServer
from services.scheduler.client import GrpcScheduler
from services.scheduler.server import build_server
from tests._selection import assert_same_selection, random_batch

DELAY_S = 0.02  # far more than a 5-request selection takes on any host


class Remote(Scheduler):
    """A scheduler `delay_s` farther away than the selection it runs (a distant or
    overloaded service, or, with 0, one as near as in-process); counts its calls."""

    def __init__(self, delay_s: float = DELAY_S) -> None:
        self.inner, self.delay_s, self.calls = LocalScheduler(), delay_s, 0

    def plan(self, n: int) -> tuple[int, int]:
        return self.inner.plan(n)

    def select(
        self,
        requests: Sequence[RequestProgress],
        trees: Sequence[CandidateTree] | TreeBatch,
        params: SelectionParams,
    ) -> Selection:
        self.calls += 1
        time.sleep(self.delay_s)
        return self.inner.select(requests, trees, params)


class SlowLocal(LocalScheduler):
    """In-process selection on a host too busy to select quickly."""

    def select(self, requests, trees, params) -> Selection:
        time.sleep(DELAY_S)
        return super().select(requests, trees, params)


def selections(where: str) -> float:
    return metrics.selections_total.labels(where)._value.get()


def run(sched: FallbackScheduler, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(n):
        requests, trees = random_batch(rng, 5)
        params = SelectionParams(40, 4, 20.0)
        assert_same_selection(sched.select(requests, trees, params), select_here(requests, trees))


def select_here(requests, trees) -> Selection:
    return LocalScheduler().select(requests, trees, SelectionParams(40, 4, 20.0))


def test_auto_selects_in_process_where_the_service_is_slower() -> None:
    remote = Remote()
    sched = FallbackScheduler(remote, LocalScheduler(), "auto")
    run(sched, 2)  # one of each, measured
    assert remote.calls == 1 and not sched.remote_in_use
    run(sched, 3 * PROBE_EVERY)
    # From then on the service only answers the probes that keep its time current.
    assert remote.calls == 1 + 3
    assert sched.healthy


def test_auto_keeps_a_service_that_is_faster() -> None:
    remote = Remote(delay_s=0.0)
    sched = FallbackScheduler(remote, SlowLocal(), "auto")
    run(sched, 2 + 2 * PROBE_EVERY)
    assert sched.remote_in_use
    assert remote.calls == 1 + 2 * PROBE_EVERY - 2  # all but the in-process probes


def test_always_sends_every_select() -> None:
    remote = Remote()
    sched = FallbackScheduler(remote, LocalScheduler(), "always")
    run(sched, 5)
    assert remote.calls == 5 and sched.remote_in_use


@pytest.fixture(scope="module")
def grpc_scheduler() -> Iterator[GrpcScheduler]:
    with (
        BackgroundServer(lambda: build_server(SchedulerSettings(), "127.0.0.1", 0)) as srv,
        GrpcScheduler(srv.address, timeout_s=5.0) as client,
    ):
        yield client


def test_auto_over_grpc_gives_the_same_selections_on_both_sides(
    grpc_scheduler: GrpcScheduler,
) -> None:
    """Against the real service: whichever side answers, the same selection, and the
    metric counts where each ran."""
    remote0, local0 = selections("remote"), selections("local")
    sched = FallbackScheduler(grpc_scheduler, LocalScheduler(), "auto")
    run(sched, 2 * PROBE_EVERY, seed=3)
    remote, local = selections("remote") - remote0, selections("local") - local0
    assert remote >= 1 and local >= 1 and remote + local == 2 * PROBE_EVERY
