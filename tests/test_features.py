"""FeatureRows (one request's target features by position) and the target's host copy
of the features: what the engine hands an EAGLE drafter."""

from __future__ import annotations

import numpy as np
import torch

from adaserve.features import FeatureRows
from adaserve.request import SamplingParams
from adaserve.runner_target import _with_features
from adaserve.target import ForwardResult, PrefillChunk, VerifyItem, VerifyResult
from adaserve.tree import CandidateTree


def rows(start: int, n: int, dim: int = 3) -> np.ndarray:
    """Row of position p: p in every column (so a window shows which it holds)."""
    return np.repeat(np.arange(start, start + n, dtype=np.float16)[:, None], dim, axis=1)


def test_rows_by_position_window_and_drop():
    f = FeatureRows(3)
    f.add(0, rows(0, 4))  # a prefill chunk: positions 0..3
    f.add(4, rows(4, 2))
    f.add(5, rows(5, 3))  # a verification whose root row is held already: 5 skipped
    assert (f.lo, f.hi) == (0, 8)
    w = f.window(-1, 3)  # tokens 0..3 need rows -1..2: a zero row first
    assert w is not None and w[:, 0].tolist() == [0, 0, 1, 2]
    assert w[0].tolist() == [0, 0, 0]
    f.drop_before(3)
    assert (f.lo, f.hi) == (3, 8) and f.window(2, 4) is None  # row 2 is gone
    got = f.window(3, 8)
    assert got is not None and got[:, 1].tolist() == [3, 4, 5, 6, 7]
    assert f.window(3, 9) is None  # not computed yet
    assert f.window(5, 5) is not None and f.window(5, 5).shape == (0, 3)
    f.add(12, rows(12, 1))  # a gap: the rows restart there, the window says what lacks
    assert (f.lo, f.hi) == (12, 13) and f.window(7, 12) is None


def test_host_features_are_float16_clipped_and_split_by_tree_and_chunk():
    tree = CandidateTree.build(np.array([5, 6, 7]), np.array([-1, 0, 0]), np.zeros(3))
    item = VerifyItem("a", tree, SamplingParams(), None, 10)
    chunk = PrefillChunk("b", np.array([1, 2], np.int32), 0, False, SamplingParams(), None)
    feats = torch.arange(5, dtype=torch.float32)[:, None].repeat(1, 4) * 1e5  # past fp16
    with torch.inference_mode():  # the runner's outputs are inference tensors
        feats = feats.clone()
    verified = VerifyResult(
        accepted_nodes=np.array([0, 2], np.int32), emitted_tokens=np.array([7, 9], np.int32)
    )
    res = _with_features(ForwardResult([verified], [None]), feats, [item], [chunk])
    assert res.tree_features is not None and res.chunk_features is not None
    (t,), (c,) = res.tree_features, res.chunk_features
    assert t.dtype == np.float16 and np.isfinite(t).all()
    assert t[:, 0].tolist() == [0.0, 65504.0]  # root and node 2; 2e5 clipped
    assert c.shape == (2, 4) and c[:, 0].tolist() == [65504.0, 65504.0]
