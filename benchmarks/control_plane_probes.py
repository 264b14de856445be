"""Timing probes for the control-plane benchmark: Drafter and Scheduler wrappers that
time each call where the engine makes it, and read the server's own timing
(ServerTiming) when the wrapped implementation is a gRPC client.

For remote calls they also record the engine thread's CPU time inside the call and
the servers' (de)serialization time: what is left of the RPC overhead after those is
transport plus waiting for threads to be scheduled, the part a loaded machine inflates.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from adaserve.drafter import Drafter, DraftUpdate
from adaserve.scheduler import LocalScheduler, Scheduler
from adaserve.selection import RequestProgress, Selection, SelectionParams
from adaserve.tree import CandidateTree


@dataclass
class Iteration:
    """Milliseconds of one iteration's control-plane calls (sums: a lost-state retry
    makes two Speculate calls). Fields marked gRPC stay 0 in-process."""

    plan_ms: float = 0.0
    plan_local_ms: float = 0.0  # gRPC: the same plan computed in-process
    spec_ms: float = 0.0
    spec_compute_ms: float = 0.0  # gRPC: server compute (in-process: = spec_ms)
    select_ms: float = 0.0
    select_compute_ms: float = 0.0  # gRPC: server compute (in-process: = select_ms)
    select_local_ms: float = 0.0  # gRPC: the same selection in-process, right after
    client_cpu_ms: float = 0.0  # gRPC: engine-thread CPU inside Plan/Speculate/Select
    server_serde_ms: float = 0.0  # gRPC: server decode + encode of Speculate and Select
    errors: int = 0
    step_ms: float = 0.0

    @property
    def rpc_ms(self) -> float:
        """Transport + serialization: each call minus the server's own compute."""
        return self.plan_ms + (self.spec_ms - self.spec_compute_ms) + self.select_rpc_ms

    @property
    def select_rpc_ms(self) -> float:
        return self.select_ms - self.select_compute_ms

    @property
    def added_ms(self) -> float:
        """What this iteration's control plane cost beyond all-in-one doing the same."""
        return (
            (self.plan_ms - self.plan_local_ms)
            + (self.select_ms - self.select_local_ms)
            + (self.spec_ms - self.spec_compute_ms)
        )


@dataclass
class Probe:
    current: Iteration = field(default_factory=Iteration)


def elapsed_ms(t0_ns: int) -> float:
    """Milliseconds since a perf_counter_ns() reading."""
    return (time.perf_counter_ns() - t0_ns) / 1e6


class _Clock:
    """Wall and engine-thread CPU time of one call."""

    def __init__(self) -> None:
        self.t0, self.c0 = time.perf_counter_ns(), time.thread_time_ns()

    def wall_ms(self) -> float:
        return elapsed_ms(self.t0)

    def cpu_ms(self) -> float:
        return (time.thread_time_ns() - self.c0) / 1e6


def _serde_ms(timing: object) -> float:
    return (timing.decode_us + timing.encode_us) / 1e3


class TimedDrafter:
    """Drafter that times the wrapped one."""

    def __init__(self, inner: Drafter, probe: Probe) -> None:
        self.inner, self.probe = inner, probe
        self.remote = hasattr(inner, "last_timing")  # GrpcDrafter

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        it = self.probe.current
        if self.remote:
            self.inner.last_timing = None  # so a failed call reads no stale timing
        clock = _Clock()
        try:
            return self.inner.speculate(updates, depth, width, stop_prob)
        except Exception:
            it.errors += 1
            raise
        finally:
            wall = clock.wall_ms()
            it.spec_ms += wall
            if not self.remote:
                it.spec_compute_ms += wall  # in-process: all of it is drafting
            elif (timing := self.inner.last_timing) is not None:
                it.client_cpu_ms += clock.cpu_ms()
                it.spec_compute_ms += timing.compute_us / 1e3
                it.server_serde_ms += _serde_ms(timing)

    def release(self, ids: list[str]) -> None:
        self.inner.release(ids)


class TimedScheduler:
    """Scheduler that times the wrapped one; for a remote one it also times the same
    call in-process right after, so each iteration has its own all-in-one baseline."""

    def __init__(self, inner: Scheduler, probe: Probe, local: LocalScheduler) -> None:
        self.inner, self.probe, self.local = inner, probe, local
        self.remote = hasattr(inner, "last_timing")  # GrpcScheduler

    def plan(self, n: int) -> tuple[int, int]:
        it = self.probe.current
        clock = _Clock()
        out = self.inner.plan(n)
        it.plan_ms += clock.wall_ms()
        if self.remote:
            it.client_cpu_ms += clock.cpu_ms()
            t0 = time.perf_counter_ns()
            self.local.plan(n)
            it.plan_local_ms += elapsed_ms(t0)
        return out

    def select(
        self,
        requests: Sequence[RequestProgress],
        trees: Sequence[CandidateTree],
        params: SelectionParams,
    ) -> Selection:
        it = self.probe.current
        clock = _Clock()
        try:
            out = self.inner.select(requests, trees, params)
        except Exception:
            it.errors += 1
            it.select_ms += clock.wall_ms()
            raise
        wall, cpu = clock.wall_ms(), clock.cpu_ms()
        it.select_ms += wall
        if not self.remote:
            it.select_compute_ms += wall  # in-process: all of it is selection
            return out
        it.client_cpu_ms += cpu
        it.select_compute_ms += self.inner.last_timing.compute_us / 1e3
        it.server_serde_ms += _serde_ms(self.inner.last_timing)
        t0 = time.perf_counter_ns()
        self.local.select(requests, trees, params)
        it.select_local_ms += elapsed_ms(t0)
        return out
