"""Algorithm 1 against brute force, and Theorem 4.1 (the beam-search bounding box)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from adaserve.selection import SelectionParams, select
from adaserve.tree import CandidateTree
from tests._selection import progress, tree_from_f
from tests._selection_strategies import trees

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def closed_subsets(tree: CandidateTree) -> list[tuple[int, float]]:
    """(size, sum of f) of every parent-closed node set containing the root."""
    f = tree.path_probs()
    out = []
    for mask in range(1 << (len(tree) - 1)):
        nodes = [0] + [i for i in range(1, len(tree)) if mask >> (i - 1) & 1]
        chosen = set(nodes)
        if all(tree.parents[i] in chosen for i in nodes[1:]):
            out.append((len(nodes), float(f[nodes].sum())))
    return out


def brute_force(ts: list[CandidateTree], a: list[float], budget: int) -> float | None:
    """The best total f over allocations meeting every A(r) within budget, or None."""
    options = [[s for s in closed_subsets(t) if s[1] >= a_k] for t, a_k in zip(ts, a, strict=True)]
    best = None
    for combo in itertools.product(*options):
        if sum(size for size, _ in combo) <= budget:
            total = sum(value for _, value in combo)
            best = total if best is None else max(best, total)
    return best


@SETTINGS
@given(
    ts=st.lists(trees(max_nodes=6), min_size=2, max_size=3),
    targets=st.lists(st.floats(0.0, 3.5), min_size=3, max_size=3),
    budget=st.integers(2, 8),
)
def test_algorithm_1_is_invalid_iff_infeasible_and_otherwise_optimal(ts, targets, budget):
    n = len(ts)
    assume(budget >= n)
    a = targets[:n]
    # Keep A(r) away from every achievable sum: f is ranked at float32 precision and
    # summed in another order than here, so exact boundaries would be a coin toss.
    for t, a_k in zip(ts, a, strict=True):
        assume(all(abs(value - a_k) > 1e-6 for _, value in closed_subsets(t)))
    requests = [progress(f"r{k}", a_k) for k, a_k in enumerate(a)]
    sel = select(requests, ts, SelectionParams(budget, depth=1, t_spec_ms=10.0, policy="optimal"))
    best = brute_force(ts, [float(x) for x in sel.a], budget)
    assert sel.invalid == (best is None)
    event("infeasible" if best is None else "feasible")
    if best is None:
        assert sel.selected == [] and sel.budget_used == 0
        return
    assert sel.budget_used <= budget
    for t, nodes, a_k in zip(ts, sel.selected, sel.a, strict=True):
        assert nodes[0] == 0 and set(t.parents[nodes[1:]].tolist()) <= set(nodes.tolist())
        assert t.path_probs()[nodes].sum() >= a_k  # every SLO met
    assert sel.expected_accepted.sum() >= best - 1e-6


def test_algorithm_1_uses_uncapped_a_and_no_n_max():
    chain = tree_from_f([-1, 0, 1, 2], [1.0, 0.9, 0.8, 0.7])
    # A = 3.2 needs every node (1 + 0.9 + 0.8 + 0.7 = 3.4), beyond depth + 1 = 2.
    sel = select(
        [progress("r", 3.2)], [chain], SelectionParams(4, 1, 10.0, policy="optimal", n_max=1)
    )
    assert not sel.invalid and sel.selected[0].tolist() == [0, 1, 2, 3]
    too_much = select([progress("r", 3.5)], [chain], SelectionParams(9, 1, 10.0, policy="optimal"))
    assert too_much.invalid  # the whole tree falls short of A
    tight = select([progress("r", 3.2)], [chain], SelectionParams(3, 1, 10.0, policy="optimal"))
    assert tight.invalid  # reachable, but not within the budget


# --- Theorem 4.1 ----------------------------------------------------------------------


def full_tree(branching: int, depth: int, seed: int) -> tuple[list[int], np.ndarray, list[int]]:
    """A full tree with random conditional probabilities: (parents, f, depths) in BFS
    order. Each node's children share a random fraction of its probability mass, as the
    top-w candidates of a drafter do."""
    rng = np.random.default_rng(seed)
    parents, f, depths = [-1], [1.0], [0]
    frontier = [0]
    for d in range(1, depth + 1):
        nxt = []
        for p in frontier:
            q = rng.dirichlet(np.ones(branching + 1))[:branching]  # mass left to others
            for c in range(branching):
                parents.append(p)
                f.append(f[p] * q[c])
                depths.append(d)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents, np.array(f), depths


def beam_search(parents: list[int], f: np.ndarray, steps: int, width: int) -> set[int]:
    """The union of every beam of a `steps`-step beam search of width `width`."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, []).append(i)
    beam, seen = [0], {0}
    for _ in range(steps):
        candidates = [c for p in beam for c in children.get(p, [])]
        beam = sorted(candidates, key=lambda c: (-f[c], c))[:width]
        seen.update(beam)
    return seen


@settings(max_examples=200, deadline=None)
@given(
    branching=st.integers(1, 4),
    depth=st.integers(1, 5),
    budget=st.integers(1, 14),
    seed=st.integers(0, 2**32 - 1),
)
def test_theorem_4_1_beam_search_of_width_b_contains_the_optimal_tree(
    branching, depth, budget, seed
):
    assume(branching**depth <= 1024)
    parents, f, depths = full_tree(branching, depth, seed)
    # The optimal size-B tree is the top-B nodes by f (the root first); ties go to the
    # shallower, then earlier node, which keeps it connected.
    optimal = sorted(range(len(f)), key=lambda i: (-f[i], depths[i], i))[:budget]
    assert all(parents[i] in optimal for i in optimal[1:])
    d_opt = max(depths[i] for i in optimal)
    assert set(optimal) <= beam_search(parents, f, d_opt, budget)
    # What Algorithm 1 picks from the whole tree is that same optimal tree.
    lp = np.zeros(len(f))
    lp[1:] = np.log(f[1:]) - np.log(f[parents[1:]])
    tree = CandidateTree.build(np.arange(len(f)), parents, np.minimum(lp, 0.0))
    sel = select(
        [progress("r", 0.0)], [tree], SelectionParams(budget, depth, 10.0, policy="optimal")
    )
    np.testing.assert_allclose(sel.expected_accepted[0], f[optimal].sum(), rtol=1e-5)
