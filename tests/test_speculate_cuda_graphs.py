"""Draft-step CUDA graph buckets: the smallest one a step of n requests fits."""

from __future__ import annotations

import pytest

from adaserve.model.cuda_graphs import DEFAULT_N_BUCKETS, pick_bucket


def test_pick_bucket():
    assert pick_bucket(1) == 1
    assert pick_bucket(3) == 4
    assert pick_bucket(13) == 16
    assert pick_bucket(256) == 256
    assert pick_bucket(257) is None
    assert pick_bucket(5, (2, 8)) == 8
    with pytest.raises(ValueError, match="n must be"):
        pick_bucket(0)
    assert tuple(sorted(DEFAULT_N_BUCKETS)) == DEFAULT_N_BUCKETS
