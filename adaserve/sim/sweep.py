"""Sweeps as in paper 001 Figs. 8-11: every policy across request rate, urgent
proportion or SLO scale, one simulation per (policy, point), written as CSV."""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from adaserve.sim.workload import Workload

SWEEP_KINDS = ("rps", "urgent", "slo-scale")
_METRICS = ("slo_attainment", "goodput", "tpot_p50_ms", "tpot_p90_ms")


def sweep_points(
    workload: Workload, kind: str, values: Sequence[float] | None = None
) -> list[tuple[float, Workload, float]]:
    """(x, workload variant, rps) for every point of the sweep."""
    sw = workload.sweeps
    if kind == "rps":
        return [(x, workload, x) for x in (values or sw.rps)]
    if kind == "urgent":
        return [
            (x, workload.with_urgent(x, sw.urgent_class), sw.fixed_rps)
            for x in (values or sw.urgent)
        ]
    if kind == "slo-scale":
        base = workload.with_urgent(sw.slo_scale_urgent, sw.urgent_class)
        return [
            (x, base.with_slo_scale(x, sw.urgent_class), sw.fixed_rps)
            for x in (values or sw.slo_scale)
        ]
    raise ValueError(f"unknown sweep {kind!r}; choose from {', '.join(SWEEP_KINDS)}")


def _run_one(args: tuple) -> dict[str, Any]:
    from adaserve.sim.driver import simulate  # workers import the engine lazily

    kind, x, wl, rps, policy, duration_s, seed = args
    summary = simulate(wl, policy, rps=rps, duration_s=duration_s, seed=seed).summary
    return {"sweep": kind, "x": x, **summary}


def run_sweep(
    workload: Workload,
    kind: str,
    policies: Sequence[str] | None = None,
    values: Sequence[float] | None = None,
    duration_s: float | None = None,
    seed: int | None = None,
    jobs: int = 1,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One summary per (point, policy), in point-major order."""
    policies = list(policies or workload.sweeps.policies)
    duration_s = duration_s or workload.sweeps.duration_s or workload.duration_s
    seed = workload.seed if seed is None else seed
    tasks = [
        (kind, x, wl, rps, p, duration_s, seed)
        for x, wl, rps in sweep_points(workload, kind, values)
        for p in policies
    ]
    bar = _progress(len(tasks), f"sweep {kind}", progress)
    results: list[dict[str, Any]] = []
    if jobs <= 1:
        for t in tasks:
            results.append(_run_one(t))
            bar.update(1)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for r in pool.map(_run_one, tasks):
                results.append(r)
                bar.update(1)
    bar.close()
    return results


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=False)


def flatten(summary: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: overall metrics, then `<class>_<metric>` per class."""
    row = {
        k: summary.get(k)
        for k in (
            "sweep",
            "x",
            "policy",
            "rps",
            "requests",
            "violations",
            "slo_attainment",
            "goodput",
            "throughput",
            "mean_accepted",
            "tpot_p50_ms",
            "tpot_p90_ms",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "mean_batch",
            "mean_tree_tokens",
        )
    }
    for cls, m in sorted(summary.get("per_class", {}).items()):
        for k in _METRICS:
            row[f"{cls}_{k}"] = m.get(k)
    return row


def write_csv(summaries: Sequence[dict[str, Any]], path: Path) -> None:
    rows = [flatten(s) for s in summaries]
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in fields})


def _fmt(v: Any) -> Any:
    return f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v)


def read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [{k: _parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _parse(v: str) -> Any:
    if v == "":
        return None
    try:
        return float(v)
    except ValueError:
        return v
