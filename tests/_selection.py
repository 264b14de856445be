"""Selection fixtures: trees from path probabilities, request progress, the paper's
Figure 2 example, random batches, and a field-by-field comparison of two selections."""

from __future__ import annotations

import numpy as np

from adaserve.selection import (
    RequestProgress,
    SelectionParams,
)
from adaserve.tree import CandidateTree


def tree_from_f(parents: list[int], f: list[float]) -> CandidateTree:
    """A tree given its path probabilities f (root first): log q = log f - log f(parent)."""
    logf = np.log(f)
    lp = [0.0] + [logf[i] - logf[p] for i, p in enumerate(parents) if i > 0]
    return CandidateTree.build(np.arange(len(f)) + 100, parents, lp)


def progress(rid: str, a: float, tpot: float = 10.0, decoded: int = 10, t_spec: float = 10.0):
    """A request whose A(r) is `a` for an iteration of t_spec ms."""
    return RequestProgress(rid, tpot, (a + decoded) * tpot - t_spec, decoded)


# Paper 000, Figure 2: two requests, budget 8, beam search with w = 2 for 3 steps, so
# each candidate tree is a root and layers (t1, t2), (t3, t4), (t5, t6). The text fixes
# f(t1) = 0.7 for r0, f(t1) = 0.5 and f(t2) = 0.4 for r1, A_cap 0.6 and 0.8 counting
# drafted tokens only (1.6 and 1.8 with the root's 1.0), and the throughput phase
# taking t3(0), t3(1), t5(0) in that order. The other values are chosen to agree.
FIG2_R0 = tree_from_f([-1, 0, 0, 1, 1, 3, 3], [1.0, 0.7, 0.2, 0.4, 0.15, 0.3, 0.08])


FIG2_R1 = tree_from_f([-1, 0, 0, 1, 2, 3, 4], [1.0, 0.5, 0.4, 0.35, 0.1, 0.2, 0.05])


FIG2_REQUESTS = [progress("r0", 1.6), progress("r1", 1.8)]


FIG2_PARAMS = SelectionParams(budget=8, depth=3, t_spec_ms=10.0)


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
