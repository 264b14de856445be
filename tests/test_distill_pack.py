"""The GGUF block decoder used to ship the target to an offline GPU machine matches
the gguf package's own dequantization."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
spec = importlib.util.spec_from_file_location(
    "distill_pack",
    Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "distill_pack.py",
)
distill_pack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(distill_pack)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_dequantize_matches_gguf(kind: str) -> None:
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, qtype)
    got = distill_pack._dequantize(raw.reshape(-1).view(np.uint8), kind, [6, 64])
    np.testing.assert_array_equal(got, ref)


def test_reverse_permute_is_a_row_permutation() -> None:
    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    out = distill_pack._reverse_permute(w, n_head=2)
    assert sorted(out[:, 0].tolist()) == sorted(w[:, 0].tolist())
    # per head of 8 rows: llama.cpp's interleaved pairs go back to two halves
    assert out[:4, 0].tolist() == [0, 6, 12, 18] and out[4:8, 0].tolist() == [3, 9, 15, 21]
