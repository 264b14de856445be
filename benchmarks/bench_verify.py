"""Verifier forward latency vs number of tree tokens: the budget curve.

One request with a committed prefix (256 tokens by default) verifies a token tree of
n nodes (a beam-shaped tree: root, then chains of width 4) in one forward; the tree
is dropped after each forward, so every measurement sees the same prefix. Sizes are
measured round-robin (rep 1 of every n, then rep 2, ...), so slow drifts of a shared
machine's load hit all sizes alike. Prints a table, writes JSON and a PNG, and names
the knee: where latency stops being flat in n (max distance below the chord,
"Kneedle"), the default token budget B for this hardware.

On a CPU, `--cpu-kernel auto mkl` measures the same forwards on adaserve's packed
few-row kernel and on MKL side by side (same round-robin, one runner each) and prints
their ratio (adaserve/model/cpu_gemm.py); the budget comes from the first.

    .venv/bin/python benchmarks/bench_verify.py [--model embedded] [--device cpu]
        [--cpu-kernel auto mkl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from adaserve.model.loader import load_runner
from adaserve.model.runner import ModelRunner, SeqInput

DEFAULT_SIZES = [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64]


def beam_tree(n: int, width: int = 4) -> np.ndarray:
    """Parents of an n-node tree: root 0, then `width` chains hanging off it."""
    return np.array([-1] + [max(0, i - width) for i in range(1, n)], dtype=np.int32)


def time_forward(
    runner: ModelRunner, sid: str, tokens: np.ndarray, parents: np.ndarray, sync, clock
) -> float:
    sync()
    t0 = clock()
    runner.forward([SeqInput(sid, tokens, parents)])
    sync()
    dt = clock() - t0
    runner.commit(sid, [])  # drop the tree, keep the prefix
    return dt


def knee(sizes: list[int], ms: list[float]) -> int:
    """Kneedle: the size whose normalized latency lies furthest below the chord from
    the first to the last point (the end of the flat part of a flat-then-linear curve)."""
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(ms, dtype=float)
    xn = (x - x[0]) / (x[-1] - x[0])
    yn = (y - y[0]) / max(y[-1] - y[0], 1e-12)
    return int(sizes[int(np.argmax(xn - yn))])


def choose_budget(sizes: list[int], ms: list[float]) -> tuple[int, str]:
    """The default token budget B and the rule that gave it.

    A GPU's curve is flat, then linear (memory-bound, then compute-bound): B is its
    knee. A CPU's curve is concave instead: the first extra token costs the most (one
    token runs as a GEMV, two already as a GEMM) and later ones less as the GEMM reuses
    weights better, so there is no knee; there B is the largest tree whose forward
    costs at most two single-token steps, i.e. verification pays off as soon as one
    drafted token per step is accepted."""
    mid = len(sizes) // 2
    first = (ms[mid] - ms[0]) / (sizes[mid] - sizes[0])
    second = (ms[-1] - ms[mid]) / (sizes[-1] - sizes[mid])
    if second > 1.5 * first:
        return knee(sizes, ms), "knee (Kneedle)"
    base = ms[sizes.index(1)] if 1 in sizes else ms[0]
    fits = [n for n, m in zip(sizes, ms, strict=True) if m <= 2 * base]
    return max(fits), "largest tree costing <= 2 single-token steps (no knee: concave curve)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (with --threads 1, robust on a shared machine)",
    )
    ap.add_argument(
        "--cpu-kernel",
        nargs="+",
        choices=["auto", "mkl"],
        default=["auto"],
        help="CPU linear kernel(s); two are measured side by side",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    kernels = list(dict.fromkeys(args.cpu_kernel))
    runners = {
        kern: load_runner(args.model, args.device, args.dtype, kv_memory_gb=0.5, cpu_kernel=kern)
        for kern in kernels
    }
    runner = runners[kernels[0]]
    dev = runner.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, runner.vocab_size, args.prefix)
    for r in runners.values():
        r.add_sequence("bench")
        r.forward([SeqInput.chain("bench", prefix)], last_only=True)
        r.commit("bench", range(args.prefix))
    trees = {
        n: (rng.integers(100, runner.vocab_size, n).astype(np.int32), beam_tree(n))
        for n in args.sizes
    }
    for r in runners.values():
        for n in args.sizes:  # warm-up: allocator, kernels, caches
            time_forward(r, "bench", *trees[n], sync, clock)
    samples = {kern: {n: [] for n in args.sizes} for kern in kernels}
    for _ in range(args.reps):
        for n in args.sizes:
            for kern, r in runners.items():
                samples[kern][n].append(time_forward(r, "bench", *trees[n], sync, clock) * 1e3)
    meds = {kern: [statistics.median(samples[kern][n]) for n in args.sizes] for kern in kernels}
    med = meds[kernels[0]]
    k, rule = choose_budget(args.sizes, med)

    print(
        f"verifier forward, prefix {args.prefix}, {dev} {runner.dtype}, "
        f"threads {torch.get_num_threads()}, {args.clock} clock, load avg {os.getloadavg()[0]:.1f}"
    )
    for kern in kernels:
        print(f"cpu kernel {kern}:")
        print(f"{'tokens':>6} {'median ms':>10} {'min ms':>8} {'ms/token':>9} {'tok/s':>8}")
        for n, m in zip(args.sizes, meds[kern], strict=True):
            low = min(samples[kern][n])
            print(f"{n:>6} {m:>10.1f} {low:>8.1f} {m / n:>9.2f} {n / m * 1e3:>8.0f}")
    if len(kernels) == 2:
        a, b = kernels
        print(f"{'tokens':>6} {f'{b} / {a} (median ms)':>22}")
        for n, x, y in zip(args.sizes, meds[a], meds[b], strict=True):
            print(f"{n:>6} {y / x:>22.2f}")
    print(f"default budget B = {k} tokens ({kernels[0]}): {rule}")

    tag = f"{dev.type}-{str(runner.dtype).removeprefix('torch.')}"
    out = args.out or Path(f"benchmarks/results/verify_{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "model": str(args.model),
        "device": str(dev),
        "dtype": str(runner.dtype),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "prefix": args.prefix,
        "reps": args.reps,
        "load_avg": os.getloadavg()[0],
        "budget_tokens": k,
        "budget_rule": rule,
        "cpu_kernels": kernels,
        "rows": [
            {
                "tokens": n,
                "median_ms": med[i],
                "samples_ms": samples[kernels[0]][n],
                **{f"median_ms_{kern}": meds[kern][i] for kern in kernels},
            }
            for i, n in enumerate(args.sizes)
        ],
    }
    out.write_text(json.dumps(result, indent=2))
    _plot(args.sizes, meds, k, out.with_suffix(".png"), f"{args.model} on {tag}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _plot(sizes: list[int], meds: dict[str, list[float]], k: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kern, med in meds.items():
        label = "median forward latency" + (f" ({kern})" if len(meds) > 1 else "")
        ax.plot(sizes, med, "o-", label=label)
    ax.axvline(k, color="gray", ls="--", label=f"budget B = {k} tokens")
    ax.set_xlabel("tree tokens verified in one forward")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
