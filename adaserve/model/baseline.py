"""The hardware's plain-decoding latency, measured on the target at startup.

SLO classes defined as a multiple of the baseline (`coding: 1.2x`) then mean the same
thing on a laptop CPU and on an H100: paper 000 defines the baseline as plain decoding
of a batch of 8 requests, which is what is timed here (`slo.baseline_tpot_ms: auto`).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

BATCH = 8
CONTEXT = 96  # paper 000's recipe: 32-token prompts, halfway through 128-token outputs


def measure_baseline_ms(runner, reps: int = 5) -> float:
    """Median latency of one decoding step for BATCH sequences of CONTEXT tokens."""
    from adaserve.model.runner import SeqInput

    ids = [f"__baseline{i}" for i in range(BATCH)]
    rng = np.random.default_rng(0)
    vocab = int(runner.vocab_size)
    try:
        for sid in ids:
            runner.add_sequence(sid)
        prompts = [rng.integers(0, vocab, size=CONTEXT, dtype=np.int32) for _ in ids]
        runner.forward(
            [SeqInput.chain(s, p) for s, p in zip(ids, prompts, strict=True)], last_only=True
        )
        for sid in ids:
            runner.commit(sid, range(CONTEXT))
        times = []
        for step in range(reps + 1):  # the first step warms up and is not counted
            toks = rng.integers(0, vocab, size=BATCH, dtype=np.int32)
            _sync(runner)
            t0 = time.perf_counter()
            runner.forward([SeqInput.chain(s, [int(t)]) for s, t in zip(ids, toks, strict=True)])
            _sync(runner)
            if step:
                times.append((time.perf_counter() - t0) * 1000.0)
            for sid in ids:
                runner.commit(sid, [0])
        return statistics.median(times)
    finally:
        for sid in ids:
            if runner.has_sequence(sid):
                runner.free(sid)


def _sync(runner) -> None:
    if torch.device(runner.device).type == "cuda":
        torch.cuda.synchronize()
