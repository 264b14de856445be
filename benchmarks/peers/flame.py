"""Flame graphs of adaserve's processes at N concurrent requests (issue 32's host time).

Starts `adaserve up` (all-in-one, or separate processes) with `make up`'s settings,
keeps N copies of the peers' chat request (benchmarks/peers/run.py: 42 prompt tokens,
128 greedy tokens) in flight back to back, and records each adaserve process with
py-spy (`--idle`, so a thread blocked in an RPC shows as time in that call) into one SVG
per process. py-spy is not a dependency: `pip install py-spy`.

    .venv/bin/python benchmarks/peers/flame.py --out out/flame --layouts aio separate

Each SVG's widest frames answer where an iteration's time goes: in the verifier,
`Engine._iterate`'s forward and draft calls against everything else; in the separate
layout, `GrpcDrafter.speculate` / `GrpcScheduler.select` (the RPCs) beside the drafter's
and scheduler's own work in their SVGs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks._server, benchmarks.peers.run from any directory

from benchmarks._server import free_port, start_up, stop_up  # noqa: E402
from benchmarks.peers.run import decode_round, prompt_ids  # noqa: E402

SERVICES = {
    "aio": ("verifier", "gateway"),
    "separate": ("verifier", "drafter", "scheduler", "gateway"),
}


def pids(service: str) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", f"adaserve.cli {service}"], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


def record(layout: str, args: argparse.Namespace, py_spy: str) -> list[Path]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = ["--target", "embedded", "--drafter", "embedded", "--config", args.config]
    if layout == "aio":
        up.append("--all-in-one")
    proc = start_up(up, port, args.out / f"{layout}.log")
    svgs: list[Path] = []
    try:
        ids = prompt_ids()
        asyncio.run(decode_round(url, ids, args.concurrency, args.max_tokens))  # warm-up
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                asyncio.run(decode_round(url, ids, args.concurrency, args.max_tokens))

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        time.sleep(1.0)
        spies = []
        for service in SERVICES[layout]:
            for pid in pids(service):
                svg = args.out / f"{layout}-{service}.svg"
                cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(args.seconds)]
                cmd += ["--rate", str(args.rate), "--idle", "--nonblocking", "-o", str(svg)]
                spies.append(
                    subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                )
                svgs.append(svg)
        for spy in spies:
            spy.wait()
        stop.set()
        loader.join()
    finally:
        stop_up(proc)
    return svgs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/flame"))
    p.add_argument("--layouts", nargs="+", choices=list(SERVICES), default=list(SERVICES))
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seconds", type=int, default=12, help="py-spy --duration")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--config", default="configs/embedded-cpu.yaml")
    args = p.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).is_file():
        print("flame.py: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for layout in args.layouts:
        for svg in record(layout, args, py_spy):
            print(f"wrote {svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
