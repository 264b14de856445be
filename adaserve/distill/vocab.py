"""Reduced draft vocabulary (FR-Spec style): the target tokens the drafter may propose.

The drafter's LM head scores only these rows of the target's embedding, which is what
makes it cheap on a CPU (the full 49152 x 576 head costs as much as ~8 of its layers).
Draft id i stands for target id d2t[i]; verification sees target ids only, so it stays
lossless. A token outside the set can never be drafted: coverage caps acceptance.
"""

from __future__ import annotations

import numpy as np

from adaserve.distill.data import Sequences


def continuation_counts(data: Sequences, vocab: int) -> np.ndarray:
    """How often each target id is a continuation token (what the drafter must predict)."""
    counts = np.zeros(vocab, dtype=np.int64)
    for i in range(len(data)):
        np.add.at(counts, data.continuation(i), 1)
    return counts


def expected_counts(data: Sequences, vocab: int) -> np.ndarray:
    """Continuation counts plus the target's top-k probability mass at every position:
    a far less noisy frequency estimate than the sampled tokens alone (on a small
    generated set it raises held-out coverage at 8192 tokens from 0.91 to 0.93)."""
    mass = continuation_counts(data, vocab).astype(np.float64)
    np.add.at(
        mass, data.topk_ids.reshape(-1), np.exp(data.topk_logp.astype(np.float32)).reshape(-1)
    )
    return mass


def select_draft_vocab(counts: np.ndarray, size: int, always: list[int]) -> np.ndarray:
    """d2t int64 [size]: the `always` ids (eos) then the most frequent others, by count."""
    if size < len(always) or size > len(counts):
        raise ValueError(
            f"draft vocabulary size must be in {len(always)}..{len(counts)}, got {size}"
        )
    order = np.argsort(-counts, kind="stable")
    rest = [int(t) for t in order if int(t) not in set(always)][: size - len(always)]
    return np.asarray(list(always) + rest, dtype=np.int64)


def coverage(counts: np.ndarray, d2t: np.ndarray) -> float:
    total = counts.sum()
    return float(counts[d2t].sum() / total) if total else 0.0
