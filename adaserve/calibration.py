"""The baseline TPOT and how it was measured, re-measured while it may be wrong.

SLO classes with `baseline_scale` and the SLO floor are multiples of the baseline, so a
baseline timed while another process held the cores (a laptop busy for a minute at
startup: 371 ms where a quiet start gives 61 ms) makes every class several times
looser for the life of the server. Two defences:

- `measure_baseline_ms` takes the fastest of several windows, each the median of a few
  steps: a busy host can only slow a step, so the minimum is the best estimate of what
  the hardware does.
- The startup measurement is *unsettled*: once the engine has been idle a while it is
  measured again, and again on a growing period while the host stays busy (load
  average at or above `cpu_load.BUSY_SHARE` of the cores). A faster result replaces it
  (never a slower one: a re-measurement can only be disturbed toward slow), and one
  taken on a quiet host settles it. The load average alone cannot vouch for the
  startup measurement: it trails a burst by a minute, and at startup it mostly shows
  our own model loading.

Torch-free: the engine passes the measurement in as a callable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from adaserve import cpu_load

# A re-measurement replaces the baseline only when this much faster: run-to-run noise
# on a quiet host is a few percent and must not move every SLO class.
ADOPT_SHARE = 0.95
# Idle seconds before the first re-measurement, doubled after each one that did not
# settle the baseline, up to the cap: a host that stays busy costs one measurement
# (~0.5 s of idle time) every few minutes.
FIRST_RETRY_S = 10.0
MAX_RETRY_S = 300.0


@dataclass(frozen=True)
class Baseline:
    """The baseline TPOT (plain decoding, batch 8) and where it came from, as `/v1/slo`
    reports it."""

    tpot_ms: float
    source: Literal["configured", "measured"]
    measured_at: float = 0.0  # unix time of the measurement in force (0: configured)
    load_1m: float = 0.0  # the host's load average when it was measured
    cores: int = 0  # usable cores then
    settled: bool = True  # False: to be measured again while idle (startup, busy host)
    recalibrations: int = 0  # how many re-measurements replaced an earlier value

    @classmethod
    def configured(cls, tpot_ms: float) -> Baseline:
        return cls(tpot_ms, "configured")

    @classmethod
    def measured(cls, tpot_ms: float, state: cpu_load.CpuState) -> Baseline:
        return cls(
            tpot_ms,
            "measured",
            measured_at=time.time(),
            load_1m=state.load_1m,
            cores=state.cores,
            settled=False,
        )


def remeasured(current: Baseline, tpot_ms: float, state: cpu_load.CpuState) -> Baseline:
    """`current` after a re-measurement of `tpot_ms` on a host in `state`: the faster
    value replaces it (past ADOPT_SHARE), and a quiet host settles it either way."""
    quiet = not cpu_load.busy(state)
    if tpot_ms < ADOPT_SHARE * current.tpot_ms:
        fresh = Baseline.measured(tpot_ms, state)
        return replace(fresh, settled=quiet, recalibrations=current.recalibrations + 1)
    return replace(current, settled=quiet)


@dataclass
class RetrySchedule:
    """When an unsettled baseline is measured again: after `delay_s` of idle time,
    doubling after each try that leaves it unsettled."""

    delay_s: float = FIRST_RETRY_S
    idle_since: float | None = None

    def due(self, now: float, idle: bool) -> bool:
        if not idle:
            self.idle_since = None
            return False
        if self.idle_since is None:
            self.idle_since = now
        return now - self.idle_since >= self.delay_s

    def tried(self, now: float) -> None:
        self.delay_s = min(2 * self.delay_s, MAX_RETRY_S)
        self.idle_since = now


@dataclass(frozen=True)
class Remeasure:
    """How the engine times the baseline again (`baseline_ms`) and, where the forward
    latency curve was measured at startup too, the curve (`curve`: a LatencyCurve)."""

    baseline_ms: Callable[[], float]
    curve: Callable[[], Any] | None = None
