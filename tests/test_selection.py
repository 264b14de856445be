"""Exact selection cases: the paper's Figure 2, the ablation policies, and bad input."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from adaserve.selection import (
    RequestProgress,
    SelectionError,
    SelectionParams,
    default_n_max,
    prefix_mask,
    select,
    slo_phase,
)
from adaserve.tree import CandidateTree, TreeBatch
from tests._selection import FIG2_PARAMS, FIG2_R0, FIG2_R1, FIG2_REQUESTS, progress, tree_from_f


def test_figure_2_phase_by_phase():
    batch = TreeBatch.from_trees([FIG2_R0, FIG2_R1])
    a = np.array([1.6, 1.8])
    # SLO phase: r1 (larger A) takes t1, t2 (1 + 0.5 + 0.4 >= 1.8); r0 takes t1 (1.7 >= 1.6).
    take, held = slo_phase(batch, a, a, budget=8, n_max=default_n_max(8, 2))
    assert take.tolist() == [2, 3]
    np.testing.assert_allclose(held, [1.7, 1.9])
    slo_nodes = prefix_mask(batch, take)
    assert np.flatnonzero(slo_nodes[0]).tolist() == [0, 1]
    assert np.flatnonzero(slo_nodes[1]).tolist() == [0, 1, 2]
    # Throughput phase: the remaining budget 3 goes to t3(0) 0.4, t3(1) 0.35, t5(0) 0.3.
    sel = select(FIG2_REQUESTS, [FIG2_R0, FIG2_R1], FIG2_PARAMS)
    assert [s.tolist() for s in sel.selected] == [[0, 1, 3, 5], [0, 1, 2, 3]]
    assert sel.budget_used == 8
    np.testing.assert_allclose(sel.a, [1.6, 1.8])
    np.testing.assert_allclose(sel.a_cap, [1.6, 1.8])
    np.testing.assert_allclose(sel.expected_accepted, [1 + 0.7 + 0.4 + 0.3, 1 + 0.5 + 0.4 + 0.35])


def test_figure_2_ablations():
    trees = [FIG2_R0, FIG2_R1]
    equal = select(FIG2_REQUESTS, trees, dataclasses.replace(FIG2_PARAMS, policy="equal"))
    # Four slots each: the top-4 of each tree.
    assert [s.tolist() for s in equal.selected] == [[0, 1, 3, 5], [0, 1, 2, 3]]
    glob = select(FIG2_REQUESTS, trees, dataclasses.replace(FIG2_PARAMS, policy="global"))
    # Roots, then the 6 best of 0.7 0.5 0.4 0.4 0.35 0.3 (ties: shallower, then r0 first).
    assert [s.tolist() for s in glob.selected] == [[0, 1, 3, 5], [0, 1, 2, 3]]
    tight = select(FIG2_REQUESTS, trees, dataclasses.replace(FIG2_PARAMS, budget=3))
    # One slot after the roots, n_max 2. Descending A serves r1 first, but its two best
    # nodes reach only 1.5 < 1.8 (Algorithm 2 would spend the slot on it anyway):
    # triage skips it and r0 reaches 1.7 >= 1.6 with t1.
    assert [s.tolist() for s in tight.selected] == [[0, 1], [0]]
    ascending = dataclasses.replace(FIG2_PARAMS, budget=3, order="ascending_a")
    # Ascending A (the FlexFlow code's order): r0 goes first and reaches 1.7 >= 1.6.
    assert [s.tolist() for s in select(FIG2_REQUESTS, trees, ascending).selected] == [[0, 1], [0]]


def test_n_max_counts_the_root():
    chain = tree_from_f([-1, 0, 1, 2, 3], [1.0, 0.5, 0.4, 0.3, 0.2])
    sel = select(
        [progress("r", 5.0)], [chain], SelectionParams(3, 4, 10.0, n_max=3, policy="adaserve")
    )
    assert sel.selected[0].tolist() == [0, 1, 2]
    # Unreachable A_cap: with no cap the whole tree goes to the request.
    sel = select([progress("r", 5.0)], [chain], SelectionParams(9, 4, 10.0, n_max=9))
    assert sel.selected[0].tolist() == [0, 1, 2, 3, 4] and sel.budget_used == 5


def test_a_cap_is_capped_by_depth():
    chain = tree_from_f([-1, 0, 1], [1.0, 0.9, 0.8])
    sel = select([progress("r", 10.0)], [chain], SelectionParams(1, 2, 10.0))
    assert sel.a[0] == pytest.approx(10.0) and sel.a_cap[0] == 3.0
    assert sel.selected[0].tolist() == [0]  # budget 1: the root only


def test_requests_already_on_track_get_only_the_throughput_phase():
    trees = [FIG2_R0, FIG2_R1]
    reqs = [progress("r0", 0.5), progress("r1", -3.0)]
    sel = select(reqs, trees, dataclasses.replace(FIG2_PARAMS, budget=3))
    # No SLO demand: the one spare slot goes to the best node overall, r0's t1 (0.7).
    assert [s.tolist() for s in sel.selected] == [[0, 1], [0]]


def test_triage_serves_a_savable_request_before_a_hopeless_one():
    trees = [FIG2_R0, FIG2_R1]
    # r1 is furthest behind (descending A serves it first) but even its n_max best nodes
    # (1 + 0.5 + 0.4 + 0.35 ...) cannot reach A_cap = d + 1 = 4: its SLO-phase slot
    # would be wasted. r0 reaches 1.6 with t1, so the one spare slot goes to r0.
    reqs = [progress("r0", 1.6), progress("r1", 6.0)]
    sel = select(reqs, trees, dataclasses.replace(FIG2_PARAMS, budget=3))
    assert [s.tolist() for s in sel.selected] == [[0, 1], [0]]
    # Algorithm 2 would have given it to r1; the throughput phase still serves r1 by f.
    roomy = select(reqs, trees, FIG2_PARAMS)
    assert roomy.selected[1].tolist() == [0, 1, 2, 3]


def test_throughput_phase_stops_where_a_node_no_longer_pays_for_its_verify_time():
    chain = tree_from_f([-1, 0, 1, 2], [1.0, 0.9, 0.6, 0.01])
    params = SelectionParams(100, 3, 10.0)
    sel = select([progress("r", 0.0)], [chain], params)
    # 0.9 * (100 + 1) > 1 and 0.6 * (100 + 2) > 1.9, but 0.01 * 103 < 2.5: the last
    # node would cost more verify time than the tokens it is expected to return.
    assert sel.selected[0].tolist() == [0, 1, 2] and sel.budget_used == 3
    # GlobalGreedy (the ablation) fills the budget regardless.
    glob = select([progress("r", 0.0)], [chain], dataclasses.replace(params, policy="global"))
    assert glob.selected[0].tolist() == [0, 1, 2, 3]


def test_empty_batch():
    sel = select([], [], SelectionParams(4, 3, 10.0))
    assert sel.selected == [] and sel.budget_used == 0 and sel.a.shape == (0,)


def test_default_n_max_is_ceil_of_1_2_b_over_n():
    for b in range(1, 200):
        for n in range(1, 40):
            assert default_n_max(b, n) == math.ceil(6 * b / (5 * n))


def _base() -> tuple[list[RequestProgress], list[CandidateTree], SelectionParams]:
    return list(FIG2_REQUESTS), [FIG2_R0, FIG2_R1], FIG2_PARAMS


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r, t, p: (r, t, dataclasses.replace(p, budget=0)), "budget"),
        (lambda r, t, p: (r, t, dataclasses.replace(p, budget=-3)), "budget"),
        (
            lambda r, t, p: (r, t, dataclasses.replace(p, budget=1)),
            "budget: 1 is smaller than the number of roots",
        ),
        (lambda r, t, p: (r, t, dataclasses.replace(p, depth=-1)), "depth"),
        (lambda r, t, p: (r, t, dataclasses.replace(p, t_spec_ms=float("nan"))), "t_spec_ms"),
        (lambda r, t, p: (r, t, dataclasses.replace(p, policy="fastest")), "policy"),
        (lambda r, t, p: (r, t, dataclasses.replace(p, order="random")), "order"),
        (lambda r, t, p: (r, t, dataclasses.replace(p, n_max=0)), "n_max"),
        (lambda r, t, p: (r[:1], t, p), "requests: 1 requests but 2 candidate trees"),
        (
            lambda r, t, p: ([dataclasses.replace(r[0], tpot_slo_ms=0.0), r[1]], t, p),
            r"requests\[0\].tpot_slo_ms",
        ),
        (
            lambda r, t, p: ([r[0], dataclasses.replace(r[1], tpot_slo_ms=-5.0)], t, p),
            r"requests\[1\].tpot_slo_ms",
        ),
        (
            lambda r, t, p: ([dataclasses.replace(r[0], tpot_slo_ms=float("nan")), r[1]], t, p),
            "tpot_slo_ms",
        ),
        (
            lambda r, t, p: ([r[0], dataclasses.replace(r[1], elapsed_ms=-1.0)], t, p),
            r"requests\[1\].elapsed_ms",
        ),
        (
            lambda r, t, p: ([r[0], dataclasses.replace(r[1], decoded=-2)], t, p),
            r"requests\[1\].decoded",
        ),
        (
            lambda r, t, p: (
                r,
                [
                    t[0],
                    CandidateTree(
                        t[1].tokens, np.array([-1, 0, 5, 1, 2, 3, 4], np.int32), t[1].logprobs
                    ),
                ],
                p,
            ),
            r"trees\[1\].parents: parent of node 2 is 5",
        ),
        (
            lambda r, t, p: (
                r,
                [CandidateTree(t[0].tokens, t[0].parents, np.full(7, 0.5, np.float32)), t[1]],
                p,
            ),
            r"trees\[0\].logprobs: positive",
        ),
        (
            lambda r, t, p: (
                r,
                [t[0], CandidateTree(t[1].tokens, t[1].parents, np.full(7, np.nan, np.float32))],
                p,
            ),
            r"trees\[1\].logprobs: NaN",
        ),
        (
            lambda r, t, p: (
                r,
                [t[0], CandidateTree(t[1].tokens, t[1].parents[:3], t[1].logprobs)],
                p,
            ),
            r"trees\[1\]: array lengths disagree",
        ),
        (
            lambda r, t, p: (
                r,
                [t[0], CandidateTree(*(np.zeros(0, d) for d in (np.int32, np.int32, np.float32)))],
                p,
            ),
            r"trees\[1\].tokens: empty tree",
        ),
    ],
)
def test_bad_input_names_the_field(change, field):
    requests, trees, params = change(*_base())
    with pytest.raises(SelectionError, match=field):
        select(requests, trees, params)
    assert issubclass(SelectionError, ValueError)


def test_budget_at_the_int64_limit_selects_every_node():
    # the wire carries int64; a budget that large must not overflow the stop rule
    tree = CandidateTree.build(
        np.array([1, 2, 3], np.int32),
        np.array([-1, 0, 1], np.int32),
        np.array([0.0, -0.1, -0.2], np.float32),
    )
    progress = [RequestProgress("a", 50.0, 10.0, 1)]
    for policy in ("adaserve", "paper", "equal", "global", "optimal"):
        params = SelectionParams(budget=2**63 - 1, depth=2, t_spec_ms=10.0, policy=policy)
        assert select(progress, [tree], params).selected[0].tolist() == [0, 1, 2]
