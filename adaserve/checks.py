"""Checks on what the drafter and the scheduler answer, before the engine acts on it.

Trees and selections are proposals: the target verifies every token, so a poor one
costs speed, never correctness, provided it is well formed and about the right
requests. These checks make that hold against a buggy, version-skewed or compromised
service. Trees: one per request, structurally valid, rooted at the request's last
committed token (the target computes that token's KV from the root), every token in
the target's vocabulary. Selections: one per tree, each naming existing nodes, the
root first, ascending, closed under parent. A failed check is a ValueError, which the
engine treats as that service failing (it falls back), never as the batch failing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from adaserve.tree import CandidateTree, TreeBatch


def check_trees(
    trees: Sequence[CandidateTree], last_tokens: Sequence[int], vocab_size: int
) -> None:
    if len(trees) != len(last_tokens):
        raise ValueError(f"drafter: {len(trees)} trees for {len(last_tokens)} requests")
    if not trees:
        return
    batch = TreeBatch.from_trees(trees)
    batch.validate()  # structure, log-probs, negative ids: vectorized over the batch
    roots = batch.tokens[batch.offsets[:-1]]
    wrong = np.flatnonzero(roots != np.asarray(last_tokens, dtype=roots.dtype))
    if wrong.size:
        k = int(wrong[0])
        raise ValueError(
            f"drafter: tree {k} is rooted at {int(roots[k])}, not at the request's "
            f"last token {int(last_tokens[k])}"
        )
    if int(batch.tokens.max()) >= vocab_size:
        raise ValueError(f"drafter: token id {int(batch.tokens.max())} >= vocab {vocab_size}")


def check_selection(selected: Sequence[np.ndarray], trees: Sequence[CandidateTree]) -> None:
    if len(selected) != len(trees):
        raise ValueError(f"scheduler: {len(selected)} selections for {len(trees)} trees")
    if not trees:
        return
    # Whole-batch arrays: selection k's entries sit at [start[k], start[k+1]) of `flat`.
    counts = np.fromiter((np.shape(x)[0] for x in selected), np.int64, len(selected))
    if counts.min() < 1:
        raise ValueError(f"scheduler: selection {int(np.argmin(counts))} is empty")
    flat = np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in selected])
    start = np.zeros(len(selected) + 1, np.int64)
    np.cumsum(counts, out=start[1:])
    owner = np.repeat(np.arange(len(selected)), counts)
    batch = TreeBatch.from_trees(trees)
    if np.any(flat[start[:-1]] != 0):
        k = int(np.argmax(flat[start[:-1]] != 0))
        raise ValueError(f"scheduler: selection {k} does not start at the root")
    step = np.diff(flat)
    step[start[1:-1] - 1] = 1  # a new selection may start lower than the last one ended
    if np.any(flat < 0) or np.any(flat >= batch.sizes[owner]) or np.any(step <= 0):
        k = int(owner[np.argmax((flat < 0) | (flat >= batch.sizes[owner]))])
        raise ValueError(f"scheduler: selection {k} is not ascending node indices of its tree")
    node = batch.offsets[owner] + flat  # index into the batch's nodes
    inside = np.zeros(batch.num_nodes, dtype=bool)
    inside[node] = True
    child = flat > 0
    parent = batch.offsets[owner[child]] + batch.parents[node[child]]
    if not inside[parent].all():
        k = int(owner[child][np.argmin(inside[parent])])
        raise ValueError(f"scheduler: selection {k} is not closed under parent")
