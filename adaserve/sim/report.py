"""Writing a run's results: the same files for a simulated and a measured run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adaserve.sim.summary import RequestRecord


def write_run(
    out_dir: Path, summary: dict[str, Any], records: Sequence[RequestRecord], plot: bool = True
) -> list[Path]:
    """`summary.json`, `requests.jsonl` (one record per request) and `latency.png`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "summary.json", out_dir / "requests.jsonl"]
    paths[0].write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
    with paths[1].open("w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")
    if plot and records:
        from adaserve.sim.plots import plot_latency

        title = f"{summary.get('policy')} @ {summary.get('rps')} req/s"
        paths.append(plot_latency(records, out_dir / "latency.png", title))
    return paths


def print_summary(summary: dict[str, Any]) -> None:
    """A short table on stdout: overall, then one line per class."""

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(
        f"{summary['policy']} @ {summary['rps']} req/s: "
        f"attainment {f(summary['slo_attainment'], '.3f')} "
        f"(TTFT {f(summary.get('ttft_attainment'), '.3f')}, "
        f"TPOT {f(summary.get('tpot_attainment'), '.3f')}), "
        f"goodput {f(summary['goodput'], '.1f')} tok/s, "
        f"throughput {f(summary.get('throughput'), '.1f')} tok/s, "
        f"mean accepted {f(summary.get('mean_accepted'), '.2f')}, "
        f"{summary['requests']} requests"
    )
    for name, c in summary["per_class"].items():
        print(
            f"  {name:<14} SLO {f(c.get('tpot_slo_ms'), '.1f')} ms"
            f" (TTFT {f(c.get('ttft_slo_ms'), '.0f')} ms)  "
            f"attainment {f(c['slo_attainment'], '.3f')}"
            f" (TTFT {f(c.get('ttft_attainment'), '.3f')}, TPOT {f(c.get('tpot_attainment'), '.3f')})"
            f"  goodput {f(c['goodput'], '.1f')}  "
            f"TPOT p50/p90 {f(c['tpot_p50_ms'], '.1f')}/{f(c['tpot_p90_ms'], '.1f')} ms  "
            f"TTFT p50/p90 {f(c['ttft_p50_ms'], '.0f')}/{f(c['ttft_p90_ms'], '.0f')} ms"
        )
