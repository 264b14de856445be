"""Random selection inputs and a field-by-field comparison of two selections, shared by
the scheduler service's tests and the remote-select tests."""

from __future__ import annotations

import numpy as np

from adaserve.selection import RequestProgress
from adaserve.tree import CandidateTree


def random_tree(rng: np.random.Generator, size: int) -> CandidateTree:
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, size)])
    logprobs = np.log(rng.uniform(0.02, 1.0, size))
    logprobs[0] = 0.0
    # Some exact ties in f, which the tie-breaking must order identically on both ends.
    if size > 3:
        logprobs[2] = logprobs[1] if parents[2] == parents[1] else logprobs[2]
    return CandidateTree.build(rng.integers(0, 50_000, size), parents, logprobs)


def random_batch(
    rng: np.random.Generator, n: int, max_size: int = 30
) -> tuple[list[RequestProgress], list[CandidateTree]]:
    requests = [
        RequestProgress(
            id=f"r{i}",
            tpot_slo_ms=float(rng.uniform(10, 150)),
            elapsed_ms=float(rng.uniform(0, 3000)),
            decoded=int(rng.integers(0, 80)),
        )
        for i in range(n)
    ]
    trees = [random_tree(rng, int(rng.integers(1, max_size + 1))) for _ in range(n)]
    return requests, trees


def assert_same_selection(got, want) -> None:
    assert got.invalid == want.invalid
    assert got.budget_used == want.budget_used
    assert len(got.selected) == len(want.selected)
    for g, w in zip(got.selected, want.selected, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got.a, want.a)
    np.testing.assert_array_equal(got.a_cap, want.a_cap)
    np.testing.assert_array_equal(got.expected_accepted, want.expected_accepted)
