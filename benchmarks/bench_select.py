"""Select latency in-process and over gRPC on loopback (p50/p99).

    .venv/bin/python benchmarks/bench_select.py --out out/bench_select

For every n (requests) and B (budget) it builds random beam-shaped candidate trees
(root + d layers of w nodes, as BeamDrafter returns), then times
- in-process: `adaserve.selection.select` on a fresh TreeBatch (nothing cached);
- gRPC: `GrpcScheduler.select` against `adaserve scheduler` in its own process
  (encode + loopback RPC + server decode/select/encode + client decode),
and prints a table, writes results.json and select_latency.png under --out.
Goal (issue 3): in-process p50 <= 0.5 ms and gRPC p50 <= 2 ms at n=128, B=512.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adaserve.selection import RequestProgress, SelectionParams, select  # noqa: E402
from adaserve.tree import TreeBatch  # noqa: E402
from services.scheduler.client import GrpcScheduler  # noqa: E402


def beam_batch(rng: np.random.Generator, n: int, depth: int, width: int) -> TreeBatch:
    """n beam trees: root, then `depth` layers of `width` nodes, each node's parent in
    the layer above (sorted, as beam search emits survivors by parent), conditional
    log-probs of a peaked distribution."""
    size = 1 + depth * width
    local = np.empty((n, size), dtype=np.int32)
    local[:, 0] = -1
    local[:, 1 : 1 + width] = 0
    for layer in range(1, depth):
        above = 1 + (layer - 1) * width
        picks = np.sort(rng.integers(0, width, size=(n, width)), axis=1)
        local[:, 1 + layer * width : 1 + (layer + 1) * width] = above + picks
    logprobs = np.log(rng.beta(0.6, 1.2, size=(n, size)).clip(1e-6, 1.0)).astype(np.float32)
    logprobs[:, 0] = 0.0
    tokens = rng.integers(0, 49_152, size=(n, size), dtype=np.int32)
    offsets = np.arange(n + 1, dtype=np.int64) * size
    return TreeBatch(tokens.ravel(), local.ravel(), logprobs.ravel(), offsets)


def progress(rng: np.random.Generator, n: int) -> list[RequestProgress]:
    slo = rng.choice([48.0, 50.0, 150.0], size=n)  # coding / chat / summarize
    elapsed = rng.uniform(0, 5000, size=n)
    decoded = (elapsed / slo * rng.uniform(0.7, 1.3, size=n)).astype(int)
    return [
        RequestProgress(f"req-{i}", float(slo[i]), float(elapsed[i]), int(decoded[i]))
        for i in range(n)
    ]


def fresh(batch: TreeBatch) -> TreeBatch:
    # A TreeBatch caches its derived arrays; time selection from scratch every call.
    return TreeBatch(batch.tokens, batch.parents, batch.logprobs, batch.offsets)


def time_calls(fn, iters: int, warmup: int) -> np.ndarray:
    for _ in range(warmup):
        fn()
    out = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out[i] = (time.perf_counter_ns() - t0) / 1e6
    return out


def start_server(port: int) -> tuple[subprocess.Popen, str]:
    script = Path(sys.executable).with_name("adaserve")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "adaserve.cli"]
    proc = subprocess.Popen(
        [*cmd, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"scheduler did not start: {line!r}")
    return proc, line.split()[-1]


def measure(client: GrpcScheduler, n: int, budget: int, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng([args.seed, n, budget])
    batch = beam_batch(rng, n, args.depth, args.width)
    reqs = progress(rng, n)
    params = SelectionParams(budget, args.depth, 20.0, policy=args.policy)
    local = time_calls(lambda: select(reqs, fresh(batch), params), args.iters, args.warmup)
    server_us: list[float] = []

    def remote() -> None:
        client.select(reqs, batch, params)
        t = client.last_timing
        server_us.append(t.decode_us + t.compute_us + t.encode_us)

    rpc = time_calls(remote, args.iters, args.warmup)
    return {
        "n": n,
        "budget": budget,
        "nodes": batch.num_nodes,
        "local_p50_ms": float(np.percentile(local, 50)),
        "local_p99_ms": float(np.percentile(local, 99)),
        "grpc_p50_ms": float(np.percentile(rpc, 50)),
        "grpc_p99_ms": float(np.percentile(rpc, 99)),
        "server_p50_ms": float(np.percentile(server_us[args.warmup :], 50)) / 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_select")
    ap.add_argument("--n", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--budget", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--policy", default="adaserve")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--address", help="use a running scheduler instead of starting one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    proc = None
    address = args.address
    if address is None:
        proc, address = start_server(0)
    client = GrpcScheduler(address, timeout_s=10.0)
    client.wait_ready(30)
    rows = []
    try:
        for n in args.n:
            for budget in args.budget:
                if budget < n:  # every root costs a slot: not a valid batch
                    continue
                row = measure(client, n, budget, args)
                rows.append(row)
                print(
                    f"n={n:4d} B={budget:5d}  in-process p50 {row['local_p50_ms']:.3f} "
                    f"p99 {row['local_p99_ms']:.3f} ms | gRPC p50 {row['grpc_p50_ms']:.3f} "
                    f"p99 {row['grpc_p99_ms']:.3f} ms (server {row['server_p50_ms']:.3f})",
                    flush=True,
                )
    finally:
        client.close()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=15)

    print_table(rows, args)
    meta = {k: v for k, v in vars(args).items() if k not in ("out",)}
    meta["cpus"] = os.cpu_count()
    meta["loadavg_1m_after"] = os.getloadavg()[0]  # the machine is shared: context for noise
    (args.out / "results.json").write_text(json.dumps({"config": meta, "rows": rows}, indent=2))
    plot(rows, args.out / "select_latency.png", args)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'select_latency.png'}")
    return 0


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nSelect latency, d={args.depth} w={args.width}, policy={args.policy} (ms); "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    head = "|    n |     B | nodes | in-proc p50 | in-proc p99 | gRPC p50 | gRPC p99 | server p50 |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['n']:4d} | {r['budget']:5d} | {r['nodes']:5d} | {r['local_p50_ms']:11.3f} | "
            f"{r['local_p99_ms']:11.3f} | {r['grpc_p50_ms']:8.3f} | {r['grpc_p99_ms']:8.3f} | "
            f"{r['server_p50_ms']:10.3f} |"
        )


def plot(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, kind, goal in ((axes[0], "local", 0.5), (axes[1], "grpc", 2.0)):
        for budget in sorted({r["budget"] for r in rows}):
            rs = [r for r in rows if r["budget"] == budget]
            ns = [r["n"] for r in rs]
            line = ax.plot(ns, [r[f"{kind}_p50_ms"] for r in rs], "o-", label=f"B={budget} p50")
            ax.plot(
                ns,
                [r[f"{kind}_p99_ms"] for r in rs],
                "x--",
                color=line[0].get_color(),
                alpha=0.6,
                label=f"B={budget} p99",
            )
        ax.axhline(goal, color="grey", lw=0.8, ls=":", label=f"goal p50 {goal} ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("requests n")
        ax.set_title("in-process select" if kind == "local" else "gRPC Select on loopback")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("latency (ms)")
    for ax in axes:
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"adaserve selection, d={args.depth} w={args.width}, policy={args.policy}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
