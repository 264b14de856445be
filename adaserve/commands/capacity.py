"""`adaserve capacity`: how many serving units a workload needs at its SLOs.

    adaserve capacity WORKLOAD.yaml --rps R [--target 0.95] [--max-units 64]
                      [--duration S] [--policy adaserve] [--routing slo] [--out FILE]

Simulates the workload (the real engine on the workload's hardware profile, routed as
the gateway routes) with more and more units until SLO attainment reaches the target;
prints each count tried and the answer (`adaserve/sim/capacity.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload YAML (e.g. workloads/adaserve-eurosys.yaml)")
    p.add_argument("--rps", type=float, required=True, help="total request rate to serve")
    p.add_argument(
        "--target",
        type=float,
        default=0.95,
        help="SLO attainment to reach: the share of requests meeting TTFT and TPOT SLOs",
    )
    p.add_argument("--max-units", type=int, default=64, help="give up above this many")
    p.add_argument(
        "--duration", type=float, default=120.0, help="simulated seconds of traffic per count"
    )
    p.add_argument("--seed", type=int, help="trace and model seed (default: the workload's)")
    p.add_argument("--policy", default="adaserve", help="serving policy (as `simulate`)")
    p.add_argument("--routing", choices=["slo", "least_outstanding"], help="(default: slo)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="adaserve setting override, e.g. slo.classes.chat.tpot_ms=40 (repeatable)",
    )
    p.add_argument("--out", help="also write the plan as JSON here")


def run(args: argparse.Namespace) -> int:
    from adaserve.commands.simulate import _parse_sets, _with_overrides
    from adaserve.sim.capacity import CapacityPoint, plan_units
    from adaserve.sim.workload import load_workload

    def show(p: CapacityPoint) -> None:
        classes = ", ".join(f"{k} {v:.3f}" for k, v in sorted(p.per_class.items()))
        print(
            f"  {p.units:>3} unit(s): attainment {p.attainment:.3f}  goodput "
            f"{p.goodput:.0f} tok/s  ({classes})",
            flush=True,
        )

    try:
        workload = load_workload(args.workload)
        if args.set:
            workload = _with_overrides(workload, _parse_sets(args.set))
        print(
            f"capacity for {workload.name} at {args.rps:g} req/s, target attainment "
            f"{args.target:g} ({args.duration:g} s simulated per count):",
            flush=True,
        )
        plan = plan_units(
            workload,
            args.policy,
            args.rps,
            args.target,
            max_units=args.max_units,
            duration_s=args.duration,
            seed=args.seed,
            routing=args.routing,
            progress=show,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"adaserve capacity: {exc}", file=sys.stderr)
        return 2
    if args.out:
        out = {
            "workload": workload.name,
            "rps": args.rps,
            "target": args.target,
            "units": plan.units,
            "points": [p.to_dict() for p in plan.points],
        }
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if plan.units is None:
        print(f"no count up to {args.max_units} units reaches {args.target:g}")
        return 1
    per_unit = args.rps / plan.units
    print(f"units needed: {plan.units} ({per_unit:.2f} req/s per unit)")
    return 0
