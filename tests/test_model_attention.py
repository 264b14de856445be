"""The reference tree-attention backend against a naive per-sequence, per-head loop,
and backend selection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.model.attention import AttentionBatch, ReferenceBackend
from adaserve.model.attention_setting import make_backend
from adaserve.model.kv_cache import KVStorage


def _naive(q, keys, values, visible, scale):
    """q [k, H, D], keys/values [L, Hkv, D], visible [k, L] -> [k, H*D]."""
    h, hk = q.shape[1], keys.shape[1]
    out = torch.empty(q.shape[0], h, q.shape[2])
    for i in range(q.shape[0]):
        for head in range(h):
            kv = head // (h // hk)  # HF repeat_kv: query head h uses KV head h // G
            s = (keys[:, kv] @ q[i, head]) * scale
            s[~torch.from_numpy(visible[i])] = float("-inf")
            out[i, head] = torch.softmax(s, 0) @ values[:, kv]
    return out.reshape(q.shape[0], -1)


def test_reference_matches_naive_on_ragged_batch() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    heads, kv_heads, d, block = 6, 2, 8, 4
    storage = KVStorage(1, 32, block, kv_heads, d, torch.float32, torch.device("cpu"))
    backend = ReferenceBackend(heads, kv_heads, d, torch.device("cpu"))
    # Three sequences: (context already cached, new nodes, visibility of new nodes).
    specs = [(5, 3), (0, 1), (9, 4)]
    free = list(rng.permutation(32 * block))  # scattered slots, as a paged cache has
    kv_slots, visible, slot_mapping, old = [], [], [], []
    for cached, k in specs:
        slots = np.array([free.pop() for _ in range(cached + k)], dtype=np.int64)
        kv_slots.append(slots)
        slot_mapping.append(slots[cached:])
        vis = rng.random((k, cached + k)) < 0.6
        vis[:, :cached] = True
        vis[np.arange(k), cached + np.arange(k)] = True  # a node always sees itself
        visible.append(vis)
        old.append(slots[:cached])
    for slots in old:  # pre-existing KV
        storage.k[0, torch.from_numpy(slots)] = torch.randn(len(slots), kv_heads, d)
        storage.v[0, torch.from_numpy(slots)] = torch.randn(len(slots), kv_heads, d)
    batch = AttentionBatch(
        [k for _, k in specs], np.concatenate(slot_mapping), kv_slots, visible, [[] for _ in specs]
    )
    t = sum(k for _, k in specs)
    q, k_new, v_new = (
        torch.randn(t, heads, d),
        torch.randn(t, kv_heads, d),
        torch.randn(t, kv_heads, d),
    )
    got = backend.attend(0, q, torch.stack([k_new, v_new], 1), storage, backend.plan(batch))
    row = 0
    for (_, k), slots, vis in zip(specs, kv_slots, visible, strict=True):
        s = torch.from_numpy(slots)
        want = _naive(q[row : row + k], storage.k[0, s], storage.v[0, s], vis, d**-0.5)
        torch.testing.assert_close(got[row : row + k], want, atol=1e-5, rtol=1e-5)
        row += k
    # The new KV landed at the new nodes' slots.
    torch.testing.assert_close(storage.k[0, torch.from_numpy(batch.slot_mapping)], k_new)


def test_backend_selection() -> None:
    cpu = torch.device("cpu")
    assert make_backend("auto", 4, 2, 8, cpu).name == "reference"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_backend("flashinfer", 4, 2, 8, cpu)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("xformers", 4, 2, 8, cpu)
