"""Capacity planning: how many serving units a workload needs to meet its SLOs.

`plan_units` replays the workload at the given rate through the simulator (the real
engine and the gateway's routing, `sim/driver.py`) with 1, 2, 4, ... units until one
count attains the target (the share of requests meeting their SLOs, TTFT and TPOT),
then bisects between the last count that fell short and that one. Attainment grows with
the unit count in practice, not by construction: the search assumes it, and each
simulated point is reported so a reader can see where it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adaserve.sim.driver import simulate
from adaserve.sim.workload import Workload


@dataclass(frozen=True)
class CapacityPoint:
    units: int
    attainment: float
    goodput: float  # tokens/s of requests that met their SLOs
    per_class: dict[str, float]  # SLO class -> attainment

    def to_dict(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "attainment": self.attainment,
            "goodput": self.goodput,
            "per_class": self.per_class,
        }


@dataclass(frozen=True)
class CapacityPlan:
    units: int | None  # the fewest that attain the target; None: not within max_units
    target: float
    points: list[CapacityPoint]  # every count simulated, by units


def plan_units(
    workload: Workload,
    policy: str,
    rps: float,
    target: float,
    *,
    max_units: int = 64,
    duration_s: float | None = None,
    seed: int | None = None,
    routing: str | None = None,
    progress: Callable[[CapacityPoint], None] | None = None,
) -> CapacityPlan:
    """The fewest units (up to `max_units`) whose simulated attainment at `rps` is at
    least `target` (a fraction in (0, 1])."""
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target}")
    if not rps > 0:
        raise ValueError(f"rps must be > 0, got {rps}")
    if max_units < 1:
        raise ValueError(f"max_units must be >= 1, got {max_units}")
    seen: dict[int, CapacityPoint] = {}

    def run(units: int) -> CapacityPoint:
        if units not in seen:
            res = simulate(
                workload.model_copy(update={"units": units}),
                policy,
                rps=rps,
                duration_s=duration_s,
                seed=seed,
                routing=routing,
            )
            s = res.summary
            seen[units] = CapacityPoint(
                units,
                float(s["slo_attainment"]),
                float(s["goodput"]),
                {k: float(v["slo_attainment"]) for k, v in s["per_class"].items()},
            )
            if progress is not None:
                progress(seen[units])
        return seen[units]

    low, high = 0, 1  # low: most units known to fall short (0: none tried)
    while run(high).attainment < target:
        if high == max_units:
            return CapacityPlan(None, target, sorted(seen.values(), key=lambda p: p.units))
        low, high = high, min(2 * high, max_units)
    while high - low > 1:
        mid = (low + high) // 2
        if run(mid).attainment >= target:
            high = mid
        else:
            low = mid
    return CapacityPlan(high, target, sorted(seen.values(), key=lambda p: p.units))
