"""Properties of every policy on random batches (hypothesis)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaserve.selection import (
    default_n_max,
    greedy_prefix,
    prefix_mask,
    select,
    slo_phase,
)
from adaserve.tree import TreeBatch
from tests._selection_strategies import batches

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def grid_of(batch: TreeBatch, selected: list[np.ndarray]) -> np.ndarray:
    mask = np.zeros((len(batch), batch.width), dtype=bool)
    for k, nodes in enumerate(selected):
        mask[k, nodes] = True
    return mask


def inside(batch: TreeBatch) -> np.ndarray:
    return np.arange(batch.width) < batch.sizes[:, None]


@pytest.mark.parametrize("policy", ["adaserve", "paper", "equal", "global"])
@SETTINGS
@given(data=st.data())
def test_selection_is_a_set_of_connected_trees_within_budget(policy, data):
    requests, trees, params = data.draw(batches(policy=policy))
    sel = select(requests, trees, params)
    assert not sel.invalid
    assert sel.budget_used <= params.budget
    assert sel.budget_used == sum(len(s) for s in sel.selected)
    for tree, nodes in zip(trees, sel.selected, strict=True):
        assert nodes[0] == 0  # every root is verified
        assert np.all(np.diff(nodes) > 0) and nodes[-1] < len(tree)
        assert set(tree.parents[nodes[1:]].tolist()) <= set(nodes.tolist())  # connected
    expected = [t.path_probs()[s].sum() for t, s in zip(trees, sel.selected, strict=True)]
    np.testing.assert_allclose(sel.expected_accepted, expected, rtol=1e-12)


@SETTINGS
@given(data=st.data())
def test_slo_phase_reaches_a_cap_unless_n_max_or_budget_stop_it(data):
    requests, trees, params = data.draw(batches())
    sel = select(requests, trees, params)
    batch = TreeBatch.from_trees(trees)
    n, budget = len(trees), params.budget
    n_max = params.n_max or default_n_max(budget, n)
    take, held = slo_phase(batch, sel.a, sel.a_cap, budget, n_max, params.order)
    assert take.min() >= 1 and take.sum() <= budget
    f = batch.path_probs_grid()
    slo = prefix_mask(batch, take)
    np.testing.assert_allclose(held, (f * slo).sum(axis=1), rtol=1e-9)
    for k in range(n):
        got = f[k, slo[k]].sum()
        if got < sel.a_cap[k] - 1e-9:
            # Short of A_cap only when the budget ran out, or when even its n_max best
            # nodes could not reach it (triage: then it keeps only its root).
            best = np.sort(f[k, : len(trees[k])])[::-1][:n_max].sum()
            assert take.sum() == budget or (take[k] == 1 and best < sel.a_cap[k] + 1e-9)
        if take[k] > 1:  # and never a node more than needed
            without_last = np.sort(f[k, slo[k]])[1:].sum()
            assert without_last < sel.a_cap[k] + 1e-6


@SETTINGS
@given(data=st.data())
def test_slo_phase_serves_requests_in_the_order_setting(data):
    requests, trees, params = data.draw(batches())
    batch = TreeBatch.from_trees(trees)
    sel = select(requests, trees, params)
    n_max = params.n_max or default_n_max(params.budget, len(trees))
    want, acc = greedy_prefix(batch, sel.a_cap, n_max)
    want = np.where(acc[np.arange(len(trees)), want - 1] >= sel.a_cap, want, 1)  # triage
    take, _ = slo_phase(batch, sel.a, sel.a_cap, params.budget, n_max, params.order)
    key = -sel.a if params.order == "descending_a" else sel.a
    ranked = np.argsort(key, kind="stable")
    # Once a request is cut short, every request after it gets nothing beyond its root.
    cut = False
    for k in ranked:
        if cut:
            assert take[k] == 1
        assert take[k] <= want[k]
        cut = cut or take[k] < want[k]
    if np.all(take == want):
        assert take.sum() <= params.budget


@SETTINGS
@given(data=st.data())
def test_throughput_phase_takes_the_global_top_of_what_is_left(data):
    requests, trees, params = data.draw(batches())
    sel = select(requests, trees, params)
    batch = TreeBatch.from_trees(trees)
    n_max = params.n_max or default_n_max(params.budget, len(trees))
    take, _ = slo_phase(batch, sel.a, sel.a_cap, params.budget, n_max, params.order)
    slo = prefix_mask(batch, take)
    final = grid_of(batch, sel.selected)
    assert np.all(final >= slo)
    added, left = final & ~slo, inside(batch) & ~final
    available = int((inside(batch) & ~slo).sum())
    assert added.sum() <= min(params.budget - take.sum(), available)
    keys, f = batch.greedy_keys(), batch.path_probs_grid()
    if added.any() and left.any():
        assert keys[added].max() < keys[left].min()
        # f is ranked at float32 precision: nothing left is better beyond that.
        assert f[added].min() >= f[left].max() * (1 - 1e-6)
    if added.sum() < min(params.budget - take.sum(), available):
        # Stopped early: the best node left would not raise accepted / (B + nodes).
        nxt = f[left][np.argmin(keys[left])]
        assert nxt * (params.budget + final.sum()) <= sel.expected_accepted.sum() * (1 + 1e-9)


@SETTINGS
@given(data=st.data())
def test_equal_gives_each_request_its_share_greedily(data):
    requests, trees, params = data.draw(batches(policy="equal"))
    sel = select(requests, trees, params)
    batch = TreeBatch.from_trees(trees)
    n, budget = len(trees), params.budget
    keys = batch.greedy_keys()
    for k, (tree, nodes) in enumerate(zip(trees, sel.selected, strict=True)):
        share = budget // n + (k < budget % n)
        assert len(nodes) == min(share, len(tree))
        rest = np.setdiff1d(np.arange(len(tree)), nodes)
        if rest.size:
            assert keys[k, nodes].max() < keys[k, rest].min()


@SETTINGS
@given(data=st.data())
def test_global_is_roots_then_the_global_top(data):
    requests, trees, params = data.draw(batches(policy="global"))
    sel = select(requests, trees, params)
    batch = TreeBatch.from_trees(trees)
    final = grid_of(batch, sel.selected)
    nonroot = inside(batch)
    nonroot[:, 0] = False
    added, left = final & nonroot, nonroot & ~final
    assert added.sum() == min(params.budget - len(trees), nonroot.sum())
    keys = batch.greedy_keys()
    if added.any() and left.any():
        assert keys[added].max() < keys[left].min()
    # GlobalGreedy ignores the SLOs: the same answer whatever A(r) is.
    relaxed = [dataclasses.replace(r, elapsed_ms=0.0) for r in requests]
    again = select(relaxed, trees, params)
    assert [s.tolist() for s in again.selected] == [s.tolist() for s in sel.selected]
