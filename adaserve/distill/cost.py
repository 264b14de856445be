"""Per-token cost of a model on this machine: the runtime's own runner, one sequence,
one decode step at a time (what a drafter pays per drafted token at width 1)."""

from __future__ import annotations

import statistics
import time

import numpy as np


def decode_ms_per_token(
    spec: str,
    role: str,
    steps: int = 32,
    prompt_len: int = 64,
    threads: int | None = None,
    quantization: str = "none",
) -> float:
    """Median wall time of one decode step after a `prompt_len`-token prefill."""
    from adaserve.model.loader import load_runner
    from adaserve.model.runner import SeqInput

    runner = load_runner(
        spec, device="cpu", role=role, kv_memory_gb=0.25, threads=threads, quantization=quantization
    )
    runner.add_sequence("cost")
    rng = np.random.default_rng(0)
    runner.forward([SeqInput.chain("cost", rng.integers(100, 1000, prompt_len))])
    runner.commit("cost", range(prompt_len))
    times = []
    for _ in range(steps + 3):  # the first steps warm caches and allocators
        t0 = time.perf_counter()
        runner.forward([SeqInput.chain("cost", [int(rng.integers(100, 1000))])])
        runner.commit("cost", [0])
        times.append(time.perf_counter() - t0)
    runner.free("cost")
    return 1000.0 * statistics.median(times[3:])
