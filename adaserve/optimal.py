"""Algorithm 1 of paper 000: the optimal allocation when f is known exactly.

The candidate trees given are taken to be the whole candidate space. Step 1 gives
every request the shortest greedy prefix of its tree whose sum of f reaches A(r)
(uncapped; the root counts 1.0 and costs one slot, as constraint (1) says). Step 2
spends the rest of B on the globally highest-f nodes left.

INVALID exactly when no feasible allocation exists: some tree's total f is below its
A(r), or the minimal prefixes together exceed B (a greedy prefix is the fewest nodes
reaching a threshold, Lemma A.1). Otherwise the result maximizes total f: the best
m-node subtree of a tree is its top-m prefix (parent-closed because a child's f never
exceeds its parent's), prefix sums are concave in m, so topping up each request's
minimal prefix with the globally best marginal nodes is optimal.
"""

from __future__ import annotations

import numpy as np

from adaserve.selection import (
    Selection,
    assemble,
    greedy_prefix,
    prefix_mask,
    throughput_phase,
)
from adaserve.tree import TreeBatch


def optimal_selection(batch: TreeBatch, a: np.ndarray, a_cap: np.ndarray, budget: int) -> Selection:
    """Selection maximizing total f subject to sum f >= A(r) for every request and at
    most `budget` nodes, or Selection(invalid=True) when none exists."""
    count, acc = greedy_prefix(batch, a)
    reached = acc[np.arange(len(batch)), count - 1] >= a
    taken = int(count.sum())
    if not reached.all() or taken > budget:
        return Selection([], a, a_cap, np.zeros(len(batch)), 0, invalid=True)
    mask = prefix_mask(batch, count)
    throughput_phase(batch, mask, budget - taken, taken)
    return assemble(batch, mask, a, a_cap)
