"""Before/after the unified iteration (issue 21): the rate, urgent-share and SLO-scale
sweeps of a workload, every policy, scored on both SLOs.

Runs `adaserve.sim.driver.simulate` for every sweep point and policy with whichever
adaserve the interpreter imports, so the same file measures two trees: run it with one
tree's `.venv/bin/python`, then with the other's, and `--compare` the two JSON files. A
request attains when it finishes, meets its TPOT SLO and, where its class sets one in
the workload file (`slo.ttft_ms`), its TTFT SLO; both are also reported on their own.
The TTFT SLOs are read from the YAML itself, so a tree whose settings do not know them
is scored on the same terms.

    .venv/bin/python benchmarks/sim/unified.py workloads/adaserve-eurosys.yaml --out after.json
    ../other/.venv/bin/python benchmarks/sim/unified.py workloads/adaserve-eurosys.yaml --out before.json
    python3 benchmarks/sim/unified.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

POLICIES = [
    "adaserve",
    "paper",
    "equal",
    "global",
    "spec-2",
    "spec-4",
    "specinfer",
    "cb",
    "cb-priority",
]


def score(records, ttft_slo: dict[str, float | None]) -> dict:
    import numpy as np

    ok = ("stop", "length")
    n = len(records)
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.finish_s for r in records if r.finish_s is not None), default=start)
    span = max(end - start, 1e-9)

    def tpot_ok(r) -> bool:
        return r.finish_reason in ok and (r.tpot_ms is None or r.tpot_ms <= r.tpot_slo_ms)

    def ttft_ok(r) -> bool:
        slo = ttft_slo.get(r.slo_class)
        return r.finish_reason in ok and (
            slo is None or (r.ttft_ms is not None and r.ttft_ms <= slo)
        )

    both = [r for r in records if tpot_ok(r) and ttft_ok(r)]
    ttfts = [r.ttft_ms for r in records if r.ttft_ms is not None]
    return {
        "requests": n,
        "attainment": len(both) / n if n else None,
        "violations": n - len(both),
        "tpot_attainment": sum(map(tpot_ok, records)) / n if n else None,
        "ttft_attainment": sum(map(ttft_ok, records)) / n if n else None,
        "goodput": sum(r.num_tokens for r in both) / span,
        "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
        "ttft_p90_ms": float(np.percentile(ttfts, 90)) if ttfts else None,
    }


def run(args: argparse.Namespace) -> None:
    import yaml

    from adaserve.sim.driver import simulate
    from adaserve.sim.sweep import sweep_points
    from adaserve.sim.workload import load_workload

    raw = yaml.safe_load(Path(args.workload).read_text())
    ttft_slo = {name: (c.get("slo") or {}).get("ttft_ms") for name, c in raw["classes"].items()}
    workload = load_workload(args.workload)
    out: list[dict] = []
    for kind in args.sweeps:
        for x, wl, rps in sweep_points(workload, kind, None):
            for policy in args.policies:
                try:
                    t0 = time.perf_counter()
                    res = simulate(wl, policy, rps=rps, duration_s=args.duration, seed=args.seed)
                except ValueError as exc:  # a policy this tree does not have
                    print(f"{kind} {x} {policy}: {exc}", file=sys.stderr)
                    continue
                row = {"sweep": kind, "x": x, "policy": policy, **score(res.records, ttft_slo)}
                out.append(row)
                print(
                    f"{kind} {x:g} {policy}: attainment {row['attainment']:.3f} "
                    f"(TTFT {row['ttft_attainment']:.3f}, TPOT {row['tpot_attainment']:.3f}) "
                    f"goodput {row['goodput']:.0f} [{time.perf_counter() - t0:.0f} s]",
                    flush=True,
                )
                Path(args.out).write_text(json.dumps(out, indent=1))


def compare(before_path: str, after_path: str, metric: str) -> None:
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    for kind in dict.fromkeys(r["sweep"] for r in after):
        rows = [r for r in after if r["sweep"] == kind]
        pols = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
        print(f"\n{kind}: {metric}, before -> after")
        print("| x | " + " | ".join(pols) + " |")
        print("|---" * (len(pols) + 1) + "|")
        for x in sorted({r["x"] for r in rows}):
            cells = []
            for p in pols:

                def get(rs, x=x, p=p, kind=kind):
                    hit = [r for r in rs if r["sweep"] == kind and r["x"] == x and r["policy"] == p]
                    v = hit[0][metric] if hit else None
                    return (
                        "-"
                        if v is None
                        else (f"{v:.3f}" if isinstance(v, float) and v < 10 else f"{v:.0f}")
                    )

                cells.append(f"{get(before)} -> {get(after)}")
            print(f"| {x:g} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("workload", nargs="?")
    ap.add_argument("--out", default="unified.json")
    ap.add_argument("--sweeps", nargs="+", default=["rps", "urgent", "slo-scale"])
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--metric", default="attainment")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare, args.metric)
    else:
        run(args)


if __name__ == "__main__":
    main()
