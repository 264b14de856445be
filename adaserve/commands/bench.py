"""`adaserve bench`: measure a running server with the simulator's workloads and metrics.

    adaserve bench serve WORKLOAD.yaml --url http://host:port [--rps R] [--duration S] --out DIR
    adaserve bench compare A_DIR B_DIR      # e.g. a simulated and a measured run

`serve` writes DIR/summary.json, DIR/requests.jsonl and DIR/latency.png, the files
`adaserve simulate` writes, so the two runs compare line by line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from adaserve.bench import PROMPT_VOCAB


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True)
    # Sub-commands' --help shows defaults too (argparse does not pass the class on).
    s = sub.add_parser(
        "serve",
        help="replay a workload against a running server",
        formatter_class=p.formatter_class,
    )
    s.add_argument("workload", help="workload YAML")
    s.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--rps", type=float, help="mean request rate (default: the workload's)")
    s.add_argument("--duration", type=float, help="trace length in seconds")
    s.add_argument("--seed", type=int, help="trace seed (default: the workload's)")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--model", help="`model` field to send (default: the server's choice)")
    s.add_argument("--api-key", help="bearer token (default: $ADASERVE_API_KEY)")
    s.add_argument(
        "--baseline-ms",
        type=float,
        help="baseline per-token latency for baseline-relative SLOs (default: the "
        "workload profile's)",
    )
    s.add_argument("--label", default="server", help="`policy` name in the summary")
    s.add_argument("--priority-by-slo", action="store_true", help="send vLLM priority = SLO")
    s.add_argument(
        "--prompt-vocab",
        default=",".join(map(str, PROMPT_VOCAB)),
        help="prompt token id range lo,hi",
    )
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    s.add_argument("--no-plots", action="store_true")
    s.add_argument("--quiet", action="store_true")
    c = sub.add_parser(
        "compare",
        help="side-by-side summaries of two or more runs",
        formatter_class=p.formatter_class,
    )
    c.add_argument("runs", nargs="+", help="run directories (or summary.json files)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.bench_command == "compare":
            return _compare(args.runs)
        return _serve(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"adaserve bench: {exc}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    import os

    from adaserve.bench.loadgen import BenchTarget, replay
    from adaserve.sim.driver import workload_profile
    from adaserve.sim.report import print_summary, write_run
    from adaserve.sim.summary import summarize
    from adaserve.sim.workload import load_workload

    wl = load_workload(args.workload)
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    lo, _, hi = args.prompt_vocab.partition(",")
    vocab = (int(lo), int(hi))
    if not 0 <= vocab[0] < vocab[1]:
        raise ValueError("--prompt-vocab needs 0 <= lo < hi")
    baseline = args.baseline_ms or workload_profile(wl).baseline_ms()
    rps = args.rps or wl.rps
    duration = args.duration or wl.duration_s
    seed = wl.seed if args.seed is None else args.seed
    requests = wl.generate(rps, duration, seed, baseline)
    target = BenchTarget(
        url=args.url,
        model=args.model,
        api_key=args.api_key or os.environ.get("ADASERVE_API_KEY"),
        prompt_vocab=vocab,
        timeout_s=args.timeout,
        priority_by_slo=args.priority_by_slo,
    )
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc="requests", disable=args.quiet, file=sys.stderr)
    # the trace's time 0, as wall-clock time (arrivals count from here, within the few ms
    # the HTTP client takes to start), so other clocks can be aligned with the run
    started_unix_s = time.time()
    records = asyncio.run(replay(requests, target, progress=lambda _r: bar.update(1)))
    bar.close()
    summary = summarize(
        records,
        args.label,
        rps,
        url=args.url,
        workload=wl.name,
        duration_s=duration,
        seed=seed,
        baseline_tpot_ms=baseline,
        errors=sum(r.finish_reason not in ("stop", "length") for r in records),
        started_unix_s=started_unix_s,
    )
    paths = write_run(Path(args.out), summary, records, plot=not args.no_plots)
    if not args.quiet:
        print_summary(summary)
        first_error = next((r.error for r in records if r.error), None)
        if first_error:
            print(f"{summary['errors']} requests failed; first error: {first_error}")
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _load(path: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise FileNotFoundError(f"no summary at {p}")
    return json.loads(p.read_text())


def _compare(paths: list[str]) -> int:
    runs = [_load(p) for p in paths]
    names = [f"{r.get('policy')}@{r.get('rps')}" for r in runs]
    rows: list[tuple[str, list[Any]]] = []
    for key in (
        "slo_attainment",
        "goodput",
        "throughput",
        "mean_accepted",
        "tpot_p50_ms",
        "tpot_p90_ms",
        "ttft_p50_ms",
        "requests",
    ):
        rows.append((key, [r.get(key) for r in runs]))
    classes = sorted({c for r in runs for c in r.get("per_class", {})})
    for c in classes:
        for key in ("slo_attainment", "goodput", "tpot_p50_ms", "tpot_p90_ms"):
            rows.append((f"{c}.{key}", [r.get("per_class", {}).get(c, {}).get(key) for r in runs]))
    width = max(len(k) for k, _ in rows)
    print(" " * width + "".join(f"{n:>18}" for n in names))
    for key, vals in rows:
        print(f"{key:<{width}}" + "".join(f"{_cell(v):>18}" for v in vals))
    return 0


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
