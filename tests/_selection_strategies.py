"""Hypothesis strategies for candidate trees and selection batches, and the
reference greedy order, shared by the selection tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from adaserve.selection import RequestProgress, SelectionParams
from adaserve.tree import CandidateTree

_LOGPROBS = st.one_of(
    st.sampled_from([0.0, -0.1, -0.25, -0.5, -0.6931471805599453, -1.0, -2.0, -4.0]),
    st.floats(min_value=-8.0, max_value=0.0, allow_nan=False, width=32),
)


@st.composite
def requests_for(draw, n: int) -> list[RequestProgress]:
    """Progress whose A(r) lands in [-1, 7] (where selection is interesting), derived
    backwards from a drawn target."""
    out = []
    for k in range(n):
        tpot = draw(st.floats(5.0, 200.0))
        decoded = draw(st.integers(0, 200))
        target = draw(st.floats(-1.0, 7.0))
        elapsed = max(0.0, (target + decoded) * tpot - 10.0)
        out.append(RequestProgress(f"r{k}", tpot, elapsed, decoded))
    return out


@st.composite
def trees(draw, max_nodes: int = 12) -> CandidateTree:
    size = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    logprobs = [0.0] + [draw(_LOGPROBS) for _ in range(1, size)]
    tokens = draw(st.lists(st.integers(0, 50_000), min_size=size, max_size=size))
    return CandidateTree.build(tokens, parents, logprobs)


@st.composite
def batches(draw, max_requests: int = 6, max_nodes: int = 12, policy: str = "adaserve"):
    """(requests, trees, params) with n <= budget."""
    ts = draw(st.lists(trees(max_nodes), min_size=1, max_size=max_requests))
    n = len(ts)
    total = sum(len(t) for t in ts)
    params = SelectionParams(
        budget=draw(st.integers(n, total + 3)),
        depth=draw(st.integers(0, 6)),
        t_spec_ms=10.0,
        policy=policy,
        n_max=draw(st.one_of(st.none(), st.integers(1, 8))),
        order=draw(st.sampled_from(["descending_a", "ascending_a"])),
    )
    return draw(requests_for(n)), ts, params


def greedy_key(tree: CandidateTree, k: int, i: int, logf: np.ndarray, depth: np.ndarray):
    """The documented greedy order: log f descending at float32 precision, then depth,
    then request, then node index."""
    return (float(np.float32(0.0 - logf[i])), int(depth[i]), k, i)
