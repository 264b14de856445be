"""Tree attention and RMSNorm from adaserve's CPU library (adaserve/model/cpu_ops.py):
the attention equals the reference backend's on random trees, batches and GQA groups
(q and kv read in place from the fused qkv row), a query's output is bitwise the same
whatever other queries share the call, a prompt chunk's row is the bits of the same
query alone or as a tree node, the norm equals torch's, and the loader puts both into fp32 CPU models only
where the library runs (MKL asked for: none of it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adaserve.model import cpu_ops
from adaserve.model.attention import AttentionBatch, ReferenceBackend
from adaserve.model.kv_cache import KVStorage, PagedKVCache
from adaserve.model.layers import RMSNorm
from adaserve.model.loader import load_runner
from tests._attention_trees import random_qkv, random_tree_batch
from tests._kernels import needs_kernel
from tests.conftest import make_tiny_model

pytestmark = needs_kernel

CPU = torch.device("cpu")


def make_cache(kv_heads: int, head_dim: int, blocks: int = 256, block_size: int = 4):
    storage = KVStorage(1, blocks, block_size, kv_heads, head_dim, torch.float32, CPU)
    storage.kv.normal_()
    return PagedKVCache(storage, blocks, block_size)


def fused_qkv(t: int, heads: int, kv_heads: int, d: int, seed: int):
    """q and kv_new as the model hands them over: views into one fused qkv row."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    return qkv[:, : heads * d].view(t, heads, d), qkv[:, heads * d :].view(t, 2, kv_heads, d)


@pytest.mark.parametrize("shape", ["random", "rooted", "chain", "flat"])
@pytest.mark.parametrize("group,head_dim", [(1, 16), (3, 64), (4, 32), (16, 16)])
def test_tree_attention_matches_the_reference(shape: str, group: int, head_dim: int) -> None:
    kv_heads = 2
    heads = kv_heads * group
    specs = [(0, 1), (5, 3), (9, 1), (30, 12), (3, 4)]  # 21 new tokens, ragged batch
    batches = [
        (c, random_tree_batch(c, specs, np.random.default_rng(group), shape))
        for c in make_pair(kv_heads, head_dim)
    ]
    (c_ref, b_ref), (c_cpu, b_cpu) = batches
    q, kv_new = fused_qkv(sum(b_ref.query_lens), heads, kv_heads, head_dim, seed=group)
    ref = ReferenceBackend(heads, kv_heads, head_dim, CPU)
    expected = ref.attend(0, q.contiguous(), kv_new.contiguous(), c_ref.storage, ref.plan(b_ref))
    cpu = cpu_ops.CpuTreeBackend(heads, kv_heads, head_dim)
    got = cpu.attend(0, q, kv_new, c_cpu.storage, cpu.plan(b_cpu))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    # ... and it wrote the new nodes' KV where the reference did.
    assert torch.equal(c_cpu.storage.kv, c_ref.storage.kv)


def make_pair(kv_heads: int, head_dim: int):
    """Two caches with the same contents, so one batch spec builds the same batch in both."""
    a = make_cache(kv_heads, head_dim)
    b = make_cache(kv_heads, head_dim)
    b.storage.kv.copy_(a.storage.kv)
    return a, b


def test_a_query_gets_the_same_bits_whatever_else_is_in_the_call() -> None:
    """The lossless argument for attention: a tree node's output does not depend on the
    other nodes or sequences verified with it."""
    heads, kv_heads, d = 9, 3, 64
    cache = make_cache(kv_heads, d)
    batch = random_tree_batch(cache, [(40, 6), (17, 3), (0, 1)], np.random.default_rng(3))
    q, kv_new = random_qkv(10, heads, kv_heads, d, torch.float32, CPU)
    cpu = cpu_ops.CpuTreeBackend(heads, kv_heads, d)
    together = cpu.attend(0, q, kv_new, cache.storage, cpu.plan(batch))
    # Each sequence alone (its KV is in the cache now): the same bits for its rows.
    start = 0
    for i, k in enumerate(batch.query_lens):
        alone = type(batch)(
            query_lens=[k],
            slot_mapping=batch.slot_mapping[start : start + k],
            kv_slots=[batch.kv_slots[i]],
            visible=[batch.visible[i]],
            block_tables=[batch.block_tables[i]],
        )
        rows = slice(start, start + k)
        got = cpu.attend(0, q[rows], kv_new[rows], cache.storage, cpu.plan(alone))
        assert torch.equal(got, together[rows]), i
        start += k


def test_a_prompt_chunk_row_is_the_bits_of_the_same_query_alone_or_as_a_tree_node() -> None:
    """Prompt chunks run here too (they went to SDPA, whose blocking over queries gave a
    position other bits in a chunk than alone): row i of a chunk of 70 is bitwise the
    output of that query attending alone to the keys up to it (a decode step), and as
    a tree node, with other branches' keys interleaved that it may not see."""
    heads, kv_heads, d = 9, 3, 64
    cache = make_cache(kv_heads, d)
    batch = random_tree_batch(cache, [(40, 70)], np.random.default_rng(5), "chain")
    q, kv_new = random_qkv(70, heads, kv_heads, d, torch.float32, CPU)
    cpu = cpu_ops.CpuTreeBackend(heads, kv_heads, d)
    chunk = cpu.attend(0, q, kv_new, cache.storage, cpu.plan(batch))
    ref = ReferenceBackend(heads, kv_heads, d, CPU)
    expected = ref.attend(0, q, kv_new, cache.storage, ref.plan(batch))
    torch.testing.assert_close(chunk, expected, atol=2e-5, rtol=1e-5)
    slots = batch.kv_slots[0]
    rng = np.random.default_rng(6)
    for i in [0, 1, 15, 16, 17, 31, 69]:
        n = 40 + i + 1  # keys it sees
        row = slice(i, i + 1)
        alone = AttentionBatch(
            [1], batch.slot_mapping[row], [slots[:n]], [np.ones((1, n), bool)], [[]]
        )
        got = cpu.attend(0, q[row], kv_new[row], cache.storage, cpu.plan(alone))
        assert torch.equal(got, chunk[row]), f"row {i} alone"
        # as a tree node: 9 keys it may not see interleaved among those it sees
        hidden = rng.choice(np.arange(200, 900), 9, replace=False)
        at = np.sort(rng.integers(1, n + 1, 9))
        tree_slots = np.insert(slots[:n], at, hidden)
        vis = np.ones((1, tree_slots.size), bool)
        vis[0, at + np.arange(9)] = False
        node = AttentionBatch([1], batch.slot_mapping[row], [tree_slots], [vis], [[]])
        got = cpu.attend(0, q[row], kv_new[row], cache.storage, cpu.plan(node))
        assert torch.equal(got, chunk[row]), f"row {i} as a tree node"


def test_a_forward_mixing_trees_and_a_prefill_chunk_gives_each_row_its_bits_alone() -> None:
    """Chunked prefill rides with trees: every row, tree node or prompt token, bit for
    bit what its sequence gets alone, and each close to the reference backend."""
    heads, kv_heads, d = 9, 3, 64
    specs = [(40, 6), (0, 41), (17, 1)]
    (c_mix, b_mix), (c_ref, b_ref) = (
        (c, random_tree_batch(c, specs, np.random.default_rng(4), "chain"))
        for c in make_pair(kv_heads, d)
    )
    b_mix = dataclasses.replace(b_mix, prefill=[False, True, False])
    t = sum(b_mix.query_lens)
    q, kv_new = fused_qkv(t, heads, kv_heads, d, seed=4)
    cpu = cpu_ops.CpuTreeBackend(heads, kv_heads, d)
    got = cpu.attend(0, q, kv_new, c_mix.storage, cpu.plan(b_mix))
    ref = ReferenceBackend(heads, kv_heads, d, CPU)
    expected = ref.attend(0, q.contiguous(), kv_new.contiguous(), c_ref.storage, ref.plan(b_ref))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(c_mix.storage.kv, c_ref.storage.kv)
    start = 0
    for i, k in enumerate(b_mix.query_lens):
        alone = AttentionBatch(
            [k],
            b_mix.slot_mapping[start : start + k],
            [b_mix.kv_slots[i]],
            [b_mix.visible[i]],
            [b_mix.block_tables[i]],
        )
        rows = slice(start, start + k)
        bits = cpu.attend(0, q[rows], kv_new[rows], c_mix.storage, cpu.plan(alone))
        assert torch.equal(got[rows], bits), i
        start += k


def test_unsupported_shapes_are_refused() -> None:
    assert cpu_ops.supports(9, 3, 64)
    assert not cpu_ops.supports(9, 3, 72)  # head_dim not a multiple of 16
    assert not cpu_ops.supports(34, 2, 64)  # 17 query heads per KV head
    with pytest.raises(ValueError, match="CpuTreeBackend"):
        cpu_ops.CpuTreeBackend(9, 3, 72)


@pytest.mark.parametrize("rows", [1, 3, 32, 257])
def test_rms_norm_matches_torch(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(576, generator=g), torch.randn(rows, 576, generator=g) * 3
    norm = cpu_ops.CpuRMSNorm(w, 1e-5)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)
    # a shape it does not take goes to torch
    x3 = x[None]
    torch.testing.assert_close(norm(x3), F.rms_norm(x3, (576,), w, 1e-5))


@pytest.mark.parametrize("cpu_kernel,expect", [("auto", True), ("mkl", False)])
def test_loader_uses_them_only_with_the_library(tmp_path, cpu_kernel, expect) -> None:
    path = make_tiny_model(
        tmp_path, "llama", seed=0, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    runner = load_runner(path, "cpu", "float32", kv_blocks=64, cpu_kernel=cpu_kernel)
    norms = [m for m in runner.model.modules() if isinstance(m, cpu_ops.CpuRMSNorm)]
    assert bool(norms) == expect
    assert all(type(m) is not RMSNorm for m in runner.model.modules()) == expect
    assert isinstance(runner.backend, cpu_ops.CpuTreeBackend) == expect
