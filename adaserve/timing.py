"""Timing a model runner on this machine: the few primitives every measurement uses,
and the two measurements the engine takes at startup (adaserve/calibration.py): the
baseline TPOT and the forward latency curve. `adaserve profile` builds a whole hardware
profile from the same primitives (adaserve/sim/measure.py).

Torch is imported only when a runner is timed: the simulator reads BASELINE_* without it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

# The baseline TPOT that SLO classes scale (paper 000): plain decoding at batch 8 with
# 32-token prompts, halfway through 128-token outputs.
BASELINE_BATCH = 8
BASELINE_CONTEXT = BASELINE_BATCH * (32 + 64)  # cached tokens over the whole batch
MAX_SEQS = 8


def median_ms(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up: first-call allocations and lazy inits are not the steady state
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


class Sequences:
    """Up to MAX_SEQS sequences with committed context on one runner."""

    def __init__(self, runner, prefix: str, context: int, rng: np.random.Generator) -> None:
        from adaserve.model.runner import SeqInput

        self.runner = runner
        self.ids = [f"{prefix}{i}" for i in range(MAX_SEQS)]
        per = max(1, context // MAX_SEQS)
        for sid in self.ids:
            runner.add_sequence(sid)
            toks = rng.integers(0, runner.vocab_size, size=per, dtype=np.int32)
            runner.forward([SeqInput.chain(sid, toks, prefill=True)], logits_indices=[per - 1])
            runner.commit(sid, range(per))

    def forward(self, tokens: int, rng: np.random.Generator, chain: bool, all_logits: bool):
        """`tokens` new nodes over min(tokens, MAX_SEQS) sequences; scratch dropped."""
        from adaserve.model.runner import SeqInput

        k = min(tokens, MAX_SEQS)
        sizes = [tokens // k + (1 if i < tokens % k else 0) for i in range(k)]
        inputs = []
        for sid, m in zip(self.ids, sizes, strict=False):
            toks = rng.integers(0, self.runner.vocab_size, size=m, dtype=np.int32)
            parents = np.arange(-1, m - 1, dtype=np.int32) if chain else np.full(m, -1, np.int32)
            inputs.append(SeqInput(sid, toks, parents))
        if all_logits:
            self.runner.forward(inputs)
        else:
            self.runner.forward(inputs, last_only=True)
        sync(self.runner)
        for sid in self.ids[:k]:
            self.runner.commit(sid, [])

    def free(self) -> None:
        for sid in self.ids:
            self.runner.free(sid)


def capacity_tokens(runner) -> int:
    """Tokens the runner's free KV blocks hold (whole blocks per sequence aside)."""
    return runner.free_blocks() * runner.block_size


def sync(runner) -> None:
    """CUDA kernels run asynchronously: a timed forward ends when the GPU is done."""
    import torch  # the simulator itself runs without torch

    if torch.device(runner.device).type == "cuda":
        torch.cuda.synchronize()


def measure_baseline_ms(runner, reps: int = 5, seed: int = 0, windows: int = 3) -> float:
    """The baseline TPOT on this runner (`slo.baseline_tpot_ms: auto`): one decoding
    step of BASELINE_BATCH sequences holding BASELINE_CONTEXT tokens, the same point
    `HardwareProfile.baseline_ms` reads off a measured profile; the fastest of `windows`
    windows, each the median of `reps` steps. Another process on the cores can only slow
    a step, so the fastest window is the best estimate of the hardware's own time
    (adaserve/calibration.py). Leaves no sequence behind."""
    rng = np.random.default_rng(seed)
    # A KV cache smaller than the measurement (engine.kv_blocks set low) measures at the
    # context it holds: the baseline reads a little fast rather than failing startup.
    per_seq = runner.free_blocks() // MAX_SEQS * runner.block_size - BASELINE_BATCH // MAX_SEQS
    context = min(BASELINE_CONTEXT, MAX_SEQS * per_seq)
    if context < MAX_SEQS:
        raise ValueError(
            "the KV cache is too small to measure slo.baseline_tpot_ms: auto "
            f"({capacity_tokens(runner)} tokens); set slo.baseline_tpot_ms or a larger "
            "engine.kv_blocks"
        )
    seqs = Sequences(runner, "__baseline", context, rng)
    try:
        step = lambda: seqs.forward(BASELINE_BATCH, rng, chain=True, all_logits=True)  # noqa: E731
        return min(median_ms(step, reps) for _ in range(max(1, windows)))
    finally:
        seqs.free()


FORWARD_CURVE_TOKENS = (1, 8, 32, 128, 512)
CONTEXT_PROBE = (128, 1024)  # a chunk of 128 tokens, at a prompt's start and 1k tokens in


def measure_forward_curve(
    runner, tokens: Sequence[int] = FORWARD_CURVE_TOKENS, reps: int = 2, seed: int = 0
) -> tuple[list[float], list[float], float]:
    """The engine's latency model (`engine.latency_curve`): forward latency against the
    tokens one forward carries, a chain of N new tokens at a sequence's start with
    logits for every row up to 32 (trees) and for the last row beyond (prefill chunks
    skip the LM head); and `context_ms`, what each thousand (query, earlier token)
    pairs add, from a 128-token chunk 1k tokens into its prompt against the same chunk
    at the start. Leaves no sequence behind."""
    from adaserve.model.runner import SeqInput

    rng = np.random.default_rng(seed)
    room = min(runner.max_model_len, capacity_tokens(runner))
    points = [t for t in tokens if t < room] or [1]

    def chunk_ms(n: int, start: int) -> float:
        def once() -> None:
            runner.add_sequence("__curve")
            try:
                if start:
                    head = rng.integers(0, runner.vocab_size, size=start, dtype=np.int32)
                    head_in = SeqInput.chain("__curve", head, prefill=True)
                    runner.forward([head_in], logits_indices=[])
                    runner.commit("__curve", range(start))
                toks = rng.integers(0, runner.vocab_size, size=n, dtype=np.int32)
                # up to 32 tokens: a tree's nodes, all logits; beyond: a chunk, its last
                prefill = n > 32
                rows = [n - 1] if prefill else list(range(n))
                sync(runner)
                t0 = time.perf_counter()
                inp = SeqInput.chain("__curve", toks, prefill=prefill)
                runner.forward([inp], logits_indices=rows)
                sync(runner)
                times.append((time.perf_counter() - t0) * 1000.0)
            finally:
                runner.free("__curve")

        times: list[float] = []
        for _ in range(max(1, reps) + 1):  # the first is a warm-up
            once()
        return statistics.median(times[1:])

    ms = [chunk_ms(n, 0) for n in points]
    k, s = CONTEXT_PROBE
    context_ms = 0.0
    if k + s < room:
        context_ms = max(0.0, (chunk_ms(k, s) - chunk_ms(k, 0)) / (k * s / 1000.0))
    return [float(t) for t in points], ms, context_ms
