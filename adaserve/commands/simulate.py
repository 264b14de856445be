"""`adaserve simulate`: replay a workload on modelled hardware through the real engine.

    adaserve simulate WORKLOAD.yaml --policy P [--k K] --rps R [--duration S] [--seed N] --out DIR
        [--phase-window SECONDS]
    adaserve simulate WORKLOAD.yaml --sweep rps|urgent|slo-scale --out DIR [--policies a,b]
    adaserve simulate --sweep random --n N --seed S --out DIR [--duration S] [--workers W]

A single run writes DIR/summary.json, DIR/requests.jsonl and DIR/latency.png; a sweep
writes DIR/sweep_<kind>.csv, DIR/sweep_<kind>.json and PNG plots of attainment and
goodput (overall and per class). `--sweep random` takes no workload: it draws N
(adaserve/sim/random_sweep.py), runs every policy on each at the rate where the best
baseline attains 0.7-0.9, and writes DIR/random_sweep.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from adaserve.config import check_keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "workload",
        nargs="?",
        help="workload YAML (e.g. workloads/adaserve-eurosys.yaml); none with --sweep random",
    )
    p.add_argument(
        "--policy",
        help="adaserve | paper | equal | global | spec-K | specinfer | cb | cb-priority",
    )
    p.add_argument("--k", type=int, help="speculation length for --policy spec")
    p.add_argument("--rps", type=float, help="mean request rate (default: the workload's)")
    p.add_argument("--duration", type=float, help="trace length in seconds")
    p.add_argument("--seed", type=int, help="trace and model seed (default: the workload's)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--sweep", choices=["rps", "urgent", "slo-scale", "random"])
    p.add_argument("--n", type=int, default=24, help="--sweep random: workloads to draw")
    p.add_argument(
        "--reuse",
        metavar="JSON",
        help="--sweep random: an earlier random_sweep.json of the same seed and duration; "
        "its rates and every policy's runs but adaserve's are kept (re-run adaserve only; "
        "a draw whose profile tables changed since runs again whole)",
    )
    p.add_argument(
        "--fresh-trace",
        type=int,
        default=0,
        metavar="K",
        help="--sweep random with --reuse: every policy again at the reused rates on fresh "
        "traces (simulator seed + K), and adaserve against the baseline best on the reused "
        "trace (the one a user who tuned on that traffic would run)",
    )
    p.add_argument("--policies", help="comma-separated policies for --sweep")
    p.add_argument("--values", help="comma-separated sweep points (default: the workload's)")
    p.add_argument(
        "--jobs",
        "--workers",
        dest="jobs",
        type=int,
        default=1,
        help="parallel simulations (worker processes) in a sweep",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="adaserve setting override, e.g. scheduler.budget=128 (repeatable); with "
        "--sweep random, for policy adaserve's runs only",
    )
    p.add_argument(
        "--set-all",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--sweep random: a setting for every policy's runs, the rate search's included "
        "(another deployment), e.g. engine.max_batch_tokens=2048 (repeatable)",
    )
    p.add_argument(
        "--phase-window",
        type=float,
        metavar="SECONDS",
        help="also write verify / draft / prefill ms and iterations per window of "
        "simulated time into summary.json (phase_windows; single runs only)",
    )
    p.add_argument(
        "--units", type=int, help="serving units behind the router (default: the workload's)"
    )
    p.add_argument(
        "--routing",
        choices=["slo", "least_outstanding"],
        help="how arrivals pick a unit, as the gateway does (default: fleet.routing, slo)",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    from adaserve.sim.workload import load_workload

    try:
        if args.sweep == "random":
            return _random_sweep(args)
        if not args.workload:
            raise ValueError("a workload YAML is required (except with --sweep random)")
        if args.set_all:
            raise ValueError("--set-all is for --sweep random (here --set reaches every policy)")
        workload = load_workload(args.workload)
        overrides = _parse_sets(args.set)
        if overrides:
            workload = _with_overrides(workload, overrides)
        if args.units is not None:
            if args.units < 1:
                raise ValueError(f"--units must be >= 1, got {args.units}")
            workload = workload.model_copy(update={"units": args.units})
        if args.sweep:
            if args.phase_window is not None:
                raise ValueError("--phase-window is for single runs, not --sweep")
            return _sweep(args, workload)
        if not args.policy:
            raise ValueError("--policy is required (or --sweep)")
        return _single(args, workload)
    except (FileNotFoundError, ValueError) as exc:
        print(f"adaserve simulate: {exc}", file=sys.stderr)
        return 2


def _single(args: argparse.Namespace, workload) -> int:
    from adaserve.sim.driver import simulate
    from adaserve.sim.report import print_summary, write_run

    if args.policy == "spec" and args.k is None:
        raise ValueError("--policy spec needs --k K (or write spec-K)")
    result = simulate(
        workload,
        args.policy,
        rps=args.rps,
        duration_s=args.duration,
        seed=args.seed,
        k=args.k if args.policy == "spec" else None,
        phase_window_s=args.phase_window,
        routing=args.routing,
    )
    paths = write_run(Path(args.out), result.summary, result.records, plot=not args.no_plots)
    if not args.quiet:
        print_summary(result.summary)
        print(
            f"wrote {', '.join(str(p) for p in paths)} "
            f"(simulated in {result.summary['sim_wall_s']:.1f} s)"
        )
    return 0


def _sweep(args: argparse.Namespace, workload) -> int:
    from adaserve.sim.plots import plot_sweep
    from adaserve.sim.sweep import flatten, run_sweep, write_csv

    policies = _csv(args.policies) if args.policies else None
    values = [float(v) for v in _csv(args.values)] if args.values else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = run_sweep(
        workload,
        args.sweep,
        policies,
        values,
        args.duration,
        args.seed,
        jobs=args.jobs,
        progress=not args.quiet,
    )
    name = args.sweep.replace("-", "_")
    csv_path = out / f"sweep_{name}.csv"
    write_csv(summaries, csv_path)
    (out / f"sweep_{name}.json").write_text(json.dumps(summaries, indent=1) + "\n")
    paths = [csv_path]
    if not args.no_plots:
        paths += plot_sweep([flatten(s) for s in summaries], args.sweep, out)
    if not args.quiet:
        for s in summaries:
            print(
                f"{args.sweep}={s['x']:<6g} {s['policy']:<12} attainment "
                f"{s['slo_attainment']:.3f}  goodput {s['goodput']:.1f}"
            )
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _random_sweep(args: argparse.Namespace) -> int:
    from adaserve.sim.random_report import write
    from adaserve.sim.random_sweep import POLICIES, run_random_sweep

    if args.workload or args.values or args.units or args.routing:
        raise ValueError("--sweep random draws its own workloads: no workload, --values")
    seed = 0 if args.seed is None else args.seed
    duration = args.duration or 60.0
    policies = _csv(args.policies) if args.policies else list(POLICIES)
    # --set applies to policy adaserve only: the baselines stay what they are, so a
    # candidate setting is measured against them (with --reuse, on the same traces).
    overrides = _parse_sets(args.set)
    deployment = _parse_sets(args.set_all, "--set-all")
    reuse = []
    if args.reuse:
        reuse = json.loads(Path(args.reuse).read_text())["workloads"]
    if args.fresh_trace and not args.reuse:
        raise ValueError("--fresh-trace re-runs an earlier sweep: give it with --reuse")
    results = run_random_sweep(
        args.n,
        seed,
        duration,
        policies,
        workers=args.jobs,
        progress=not args.quiet,
        reuse=reuse,
        partial=Path(args.out) / "random_sweep.partial.json",
        overrides=overrides,
        deployment=deployment,
        fresh=args.fresh_trace,
    )
    sets = "".join(f" --set-all {kv}" for kv in args.set_all or ())
    sets += "".join(f" --set {kv}" for kv in args.set or ())
    header = (
        f"`adaserve simulate --sweep random --n {args.n} --seed {seed} --duration {duration:g}"
        f"{sets}`"
        + (
            f" (every policy on fresh traces, seed + {args.fresh_trace}, at the rates of "
            f"`{args.reuse}`)"
            if args.fresh_trace
            else f" (adaserve re-run over `{args.reuse}`)"
            if args.reuse
            else ""
        )
        + "\n"
    )
    paths = write(results, Path(args.out), header)
    (Path(args.out) / "random_sweep.partial.json").unlink(missing_ok=True)  # now complete
    if not args.quiet:
        print(paths[1].read_text())
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _parse_sets(items: list[str], option: str = "--set") -> dict[str, Any]:
    """`a.b=1` -> {"a": {"b": 1}}; values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} takes KEY=VALUE, got {item!r}")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(value)
    try:
        check_keys(out)
    except ValueError as exc:
        raise ValueError(f"{option} {exc}") from None
    return out


def _with_overrides(workload, overrides: dict[str, Any]):
    from adaserve.sim.driver import merge_settings

    return workload.model_copy(update={"settings": merge_settings(workload.settings, overrides)})
