"""Routing across serving units in the simulator: least outstanding requests against
SLO-aware routing (adaserve/routing.py, the gateway's own code), same traces, side by
side. Prints one row per (rate, seed) and the means; writes JSON with --out.

    .venv/bin/python benchmarks/sim/routing.py --units 4 --rps 16 17.6 19.2 20.8 \\
        --seeds 0 1 2 --duration 120 --out out/sim-routing.json

Each run is `adaserve simulate WORKLOAD --policy adaserve --units U --rps R --seed S
--duration D --routing least_outstanding|slo`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaserve.sim.driver import simulate
from adaserve.sim.workload import load_workload

ROUTINGS = ("least_outstanding", "slo")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="workloads/adaserve-eurosys.yaml")
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--rps", type=float, nargs="+", default=[16.0, 17.6, 19.2, 20.8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--out", help="write every run's numbers here (JSON)")
    args = p.parse_args()
    workload = load_workload(args.workload).model_copy(update={"units": args.units})
    rows = []
    print("req/s seed | routing            attainment (coding chat summ.)  goodput tok/s")
    for rps in args.rps:
        for seed in args.seeds:
            for routing in ROUTINGS:
                s = simulate(
                    workload,
                    "adaserve",
                    rps=rps,
                    duration_s=args.duration,
                    seed=seed,
                    routing=routing,
                ).summary
                cls = {k: v["slo_attainment"] for k, v in s["per_class"].items()}
                rows.append(
                    {
                        "rps": rps,
                        "seed": seed,
                        "routing": routing,
                        "attainment": s["slo_attainment"],
                        "goodput": s["goodput"],
                        "per_class": cls,
                    }
                )
                per = " ".join(f"{cls[c]:.3f}" for c in sorted(cls))
                print(
                    f"{rps:5g} {seed:4d} | {routing:<18} {s['slo_attainment']:.3f} ({per})"
                    f"  {s['goodput']:.0f}",
                    flush=True,
                )
    for rps in args.rps:
        for routing in ROUTINGS:
            runs = [r for r in rows if r["rps"] == rps and r["routing"] == routing]
            att = sum(r["attainment"] for r in runs) / len(runs)
            good = sum(r["goodput"] for r in runs) / len(runs)
            print(f"mean {rps:5g} | {routing:<18} attainment {att:.3f}  goodput {good:.0f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
