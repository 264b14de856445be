"""Random tree batches over a real paged KV cache, for the attention tests and
benchmarks/gpu/run_all.py.

`random_tree_batch` lays out sequences the way the runner does (committed prefix,
then scratch nodes with random parents) and returns the backend-neutral `AttentionBatch`
plus random q/k/v for its new nodes, so a backend can be checked or timed without a
model around it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from adaserve.model.attention import AttentionBatch
from adaserve.model.kv_cache import PagedKVCache


def random_parents(k: int, rng: np.random.Generator, shape: str = "random") -> np.ndarray:
    """Parents of k new scratch nodes: `random` trees hang every node off -1 or an
    earlier node; `chain` is a prefill chunk; `rooted` hangs everything below node 0
    (a verification tree); `flat` makes k children of the prefix (a draft step)."""
    if shape == "chain":
        return np.arange(-1, k - 1, dtype=np.int32)
    if shape == "flat":
        return np.full(k, -1, dtype=np.int32)
    if shape == "rooted":
        return np.asarray([-1] + [int(rng.integers(0, i)) for i in range(1, k)], dtype=np.int32)
    if shape == "random":
        return np.asarray([int(rng.integers(-1, i)) for i in range(k)], dtype=np.int32)
    raise ValueError(f"unknown tree shape {shape!r}")


def random_tree_batch(
    cache: PagedKVCache,
    specs: Sequence[tuple[int, int]],
    rng: np.random.Generator,
    shape: str = "random",
    prefix: str = "s",
) -> AttentionBatch:
    """Add one sequence per (committed_len, new_nodes) spec to `cache` (committed KV is
    whatever the slots hold), append random scratch trees, and describe them."""
    bs = cache.block_size
    q_lens, slot_mapping, kv_slots, visible, tables = [], [], [], [], []
    for i, (committed, k) in enumerate(specs):
        sid = f"{prefix}{i}"
        cache.add(sid)
        seq = cache.get(sid)
        cache.reserve({sid: committed + k})
        seq.committed = committed
        before = seq.total_len
        seq.append_scratch(random_parents(k, rng, shape).astype(np.int64))
        vis = np.ones((k, seq.total_len), dtype=bool)
        vis[:, seq.committed :] = seq.ancestors[-k:]
        q_lens.append(k)
        slot_mapping.append(seq.slots(before, seq.total_len, bs))
        kv_slots.append(seq.slots(0, seq.total_len, bs))
        visible.append(vis)
        tables.append(list(seq.block_table))
    return AttentionBatch(q_lens, np.concatenate(slot_mapping), kv_slots, visible, tables)


def random_qkv(
    num_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, D] and the new nodes' kv [T, 2, kv_heads, D] (k | v)."""

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    return r(num_tokens, heads, head_dim), r(num_tokens, 2, kv_heads, head_dim)
