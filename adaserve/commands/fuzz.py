"""`adaserve fuzz --seconds N --seed S`: differential testing of a server's OpenAI API,
speculative decoding against plain decoding (adaserve/bench/fuzz.py).

Without `--url` it starts `adaserve up --all-in-one` (the embedded pair) on a free port
and stops it at the end. Prints one JSON summary (cases, requests, the features the
cases covered, the largest logprob gap seen) and, per mismatch, the shrunk request as
JSON; exit status 1 when any case mismatched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to draw cases")
    parser.add_argument("--seed", type=int, default=0, help="cases are drawn from it")
    parser.add_argument("--max-cases", type=int, default=None, help="stop after this many")
    parser.add_argument(
        "--case",
        type=int,
        default=0,
        help="the first case to draw (with --max-cases 1: replay one case of the seed)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=3, help="cases in flight (two requests each)"
    )
    parser.add_argument(
        "--url", default=None, help="a running server (default: start an all-in-one one)"
    )
    parser.add_argument(
        "--up-args",
        default="",
        help="extra `adaserve up --all-in-one` arguments when it starts the server",
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks of the server it starts (16 tokens each): few enough that "
        "concurrent cases preempt each other (e.g. 48)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")


def run(args: argparse.Namespace) -> int:
    from adaserve.bench.fuzz import Fuzzer, all_in_one, free_port, preemptions

    if args.seconds <= 0 or args.concurrency < 1 or (args.kv_blocks or 1) < 1:
        print(
            "adaserve fuzz: --seconds must be > 0, --concurrency and --kv-blocks >= 1",
            file=sys.stderr,
        )
        return 2

    def go(url: str) -> dict:
        fuzzer = Fuzzer(url, args.seed, args.concurrency)
        report = asyncio.run(fuzzer.run(args.seconds, args.max_cases, args.case))
        return {"seed": args.seed, **report.summary(), "mismatch_details": report.mismatches}

    if args.url:
        result = go(args.url)
    else:
        with tempfile.TemporaryDirectory(prefix="adaserve-fuzz-") as tmp:
            print("adaserve fuzz: starting adaserve up --all-in-one ...", file=sys.stderr)
            port = free_port()  # the engine's metrics: how often it preempted
            up = args.up_args.split()
            with all_in_one(Path(tmp), up, kv_blocks=args.kv_blocks, metrics_port=port) as url:
                result = go(url)
                result["server_preemptions"] = preemptions(f"http://127.0.0.1:{port}/metrics")
    for m in result["mismatch_details"]:
        print(f"MISMATCH case {m['case']} (seed {m['seed']}):", file=sys.stderr)
        for d in m["differences"]:
            print(f"  {d}", file=sys.stderr)
        print("minimal reproducer: " + json.dumps(m["reproducer"]), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if result["mismatches"] else 0
