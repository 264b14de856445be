"""CPU tests of the GPU attention backends' metadata: the Triton kernel's arrays
(prefix split, mask bits, slot tables, row blocks) and FlashInfer's page table and
custom mask, each checked against the reference backend's attention on random trees.
The kernels themselves run in tests/test_gpu_attention.py (CUDA) and, where triton is
installed, through Triton's CPU interpreter below."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.model.attention import AttentionBatch, ReferenceBackend
from adaserve.model.attention_flashinfer import build_paged_arrays
from adaserve.model.attention_setting import make_backend
from adaserve.model.attention_triton import (
    build_arrays,
    pick_block_m,
    prefix_length,
    reference_from_arrays,
)
from adaserve.model.kv_cache import KVStorage, PagedKVCache
from tests._attention_trees import random_qkv, random_tree_batch

CPU = torch.device("cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def make_cache(blocks: int = 256, block_size: int = 4, kv_heads: int = 2, head_dim: int = 8):
    storage = KVStorage(1, blocks, block_size, kv_heads, head_dim, torch.float32, CPU)
    storage.kv.normal_()
    return PagedKVCache(storage, blocks, block_size)


SPECS = [(0, 1), (5, 3), (0, 7), (9, 1), (30, 20), (3, 16)]


def test_prefix_length_counts_leading_all_visible_columns() -> None:
    vis = np.array([[1, 1, 1, 0], [1, 1, 0, 1]], dtype=bool)
    assert prefix_length(vis) == 2
    assert prefix_length(np.ones((3, 5), dtype=bool)) == 5
    assert prefix_length(np.array([[0, 1]], dtype=bool)) == 0
    assert prefix_length(np.zeros((2, 0), dtype=bool)) == 0


@pytest.mark.parametrize("shape", ["random", "rooted", "chain", "flat"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_kernel_arrays_compute_reference_attention(shape: str, group: int) -> None:
    """The arrays, read the way the kernel reads them, give the reference backend's
    output: prefix split, mask columns, slots and packing are right."""
    rng = np.random.default_rng(7 + group)
    kv_heads, head_dim = 2, 8
    heads = kv_heads * group
    cache = make_cache(kv_heads=kv_heads, head_dim=head_dim)
    batch = random_tree_batch(cache, SPECS, rng, shape)
    arrays = build_arrays(batch, group, pick_block_m(max(batch.query_lens) * group))
    q, kv_new = random_qkv(sum(batch.query_lens), heads, kv_heads, head_dim, torch.float32, CPU)

    ref = ReferenceBackend(heads, kv_heads, head_dim, CPU)
    expected = ref.attend(0, q, kv_new, cache.storage, ref.plan(batch))  # also writes kv_new
    got = reference_from_arrays(arrays, q, cache.storage.k[0], cache.storage.v[0], head_dim**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=2e-5, rtol=1e-5)


def test_kernel_arrays_shapes_and_row_blocks() -> None:
    rng = np.random.default_rng(1)
    cache = make_cache()
    batch = random_tree_batch(cache, SPECS, rng, "rooted")
    group, bm = 3, 16
    a = build_arrays(batch, group, bm)
    assert a.q_len.tolist() == [k for _, k in SPECS]
    assert a.kv_len.tolist() == [c + k for c, k in SPECS]
    # A rooted tree: the committed prefix and the root are seen by every node.
    assert a.prefix_len.tolist() == [c + 1 for c, _ in SPECS]
    # Every (query, head-in-group) row of every sequence is in exactly one block.
    for i, (_, k) in enumerate(SPECS):
        starts = a.prog_row[a.prog_seq == i]
        assert starts.tolist() == list(range(0, k * group, bm))
    assert a.q_start.tolist() == np.concatenate([[0], np.cumsum(a.q_len)[:-1]]).tolist()
    for i, slots in enumerate(batch.kv_slots):
        assert a.slots[i, : len(slots)].tolist() == slots.tolist()


def test_kernel_arrays_reject_inconsistent_batch() -> None:
    rng = np.random.default_rng(2)
    batch = random_tree_batch(make_cache(), [(2, 3)], rng)
    bad = type(batch)(
        batch.query_lens,
        batch.slot_mapping,
        batch.kv_slots,
        [batch.visible[0][:2]],
        batch.block_tables,
    )
    with pytest.raises(ValueError, match="visibility"):
        build_arrays(bad, 1, 16)


def test_pick_block_m() -> None:
    assert pick_block_m(1) == 16
    assert pick_block_m(16) == 16
    assert pick_block_m(17) == 32
    assert pick_block_m(4096) == 64


# -- FlashInfer metadata ------------------------------------------------------------------


def test_flashinfer_page_table_and_mask() -> None:
    rng = np.random.default_rng(3)
    cache = make_cache(block_size=4)
    batch = random_tree_batch(cache, SPECS, rng, "random")
    a = build_paged_arrays(batch, block_size=4)
    assert a.qo_indptr.tolist() == [0, *np.cumsum([k for _, k in SPECS]).tolist()]
    for i, slots in enumerate(batch.kv_slots):
        pages = a.kv_indices[a.kv_indptr[i] : a.kv_indptr[i + 1]]
        last = int(a.kv_last_page_len[i])
        assert 1 <= last <= 4
        # Page table + last page length address exactly the sequence's slots.
        rebuilt = [
            p * 4 + o for j, p in enumerate(pages) for o in range(4 if j < len(pages) - 1 else last)
        ]
        assert rebuilt == slots.tolist()
    assert np.array_equal(a.custom_mask, np.concatenate([v.reshape(-1) for v in batch.visible]))


def test_flashinfer_metadata_rejects_wrong_block_size() -> None:
    """Blocks 5 then 2 of size 4: read with size 8 those slots would be other KV."""
    slots = np.array([20, 21, 22, 23, 8, 9], dtype=np.int64)
    batch = AttentionBatch([1], slots[-1:], [slots], [np.ones((1, 6), dtype=bool)], [[5, 2]])
    assert build_paged_arrays(batch, block_size=4).kv_indices.tolist() == [5, 2]
    with pytest.raises(ValueError, match="block_size=8"):
        build_paged_arrays(batch, block_size=8)


# -- backend registration ------------------------------------------------------------------


def test_make_backend_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("nope", 4, 2, 8, CPU)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_backend("flashinfer", 4, 2, 8, CPU)


@pytest.mark.skipif(HAS_TRITON, reason="triton is installed here")
def test_triton_backend_without_triton_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the CUDA check: the import fails
    with pytest.raises(ValueError, match="triton package does not import"):
        make_backend("triton", 4, 2, 8, CPU)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (CUDA builds of torch ship it)")
@pytest.mark.slow
def test_triton_kernel_in_interpreter_matches_reference() -> None:
    """The real kernel, run by Triton's CPU interpreter in a fresh process (the
    interpreter must be chosen before triton is imported)."""
    script = textwrap.dedent(
        """
        import numpy as np, torch
        from adaserve.model.attention import ReferenceBackend
        from adaserve.model.attention_triton import TritonBackend
        from adaserve.model.kv_cache import KVStorage, PagedKVCache
        from tests._attention_trees import random_qkv, random_tree_batch
        cpu = torch.device("cpu")
        for group, shape in [(3, "random"), (4, "rooted"), (1, "chain")]:
            st = KVStorage(1, 64, 4, 2, 16, torch.float32, cpu)
            st.kv.normal_()
            cache = PagedKVCache(st, 64, 4)
            batch = random_tree_batch(cache, [(5, 3), (0, 4), (30, 20)], np.random.default_rng(0), shape)
            q, kv_new = random_qkv(sum(batch.query_lens), 2 * group, 2, 16, torch.float32, cpu)
            ref = ReferenceBackend(2 * group, 2, 16, cpu)
            want = ref.attend(0, q, kv_new, st, ref.plan(batch))
            tri = TritonBackend(2 * group, 2, 16, cpu)
            got = tri.attend(0, q, kv_new, st, tri.plan(batch))
            assert torch.allclose(got, want, atol=1e-4), (group, shape, (got - want).abs().max())
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=Path(__file__).resolve().parents[1],  # tests._attention_trees imports from here
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
