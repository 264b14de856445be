"""Paged KV cache bookkeeping: allocator, all-or-nothing reservation, commits that move
KV down the chain, and no leaked blocks after many accept/reject cycles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.model.block_manager import BlockManager
from adaserve.model.kv_cache import KVCacheFull, KVStorage, PagedKVCache


def _cache(num_blocks: int = 16, block_size: int = 4) -> PagedKVCache:
    storage = KVStorage(2, num_blocks, block_size, 1, 2, torch.float32, torch.device("cpu"))
    return PagedKVCache(storage, num_blocks, block_size)


def _append(cache: PagedKVCache, sid: str, parents: list[int]) -> None:
    cache.reserve({sid: len(parents)})
    cache.get(sid).append_scratch(np.asarray(parents, dtype=np.int64))


def test_blocks_are_handed_out_once() -> None:
    blocks = BlockManager(5, 4)
    blocks.add("a")
    blocks.add("b")
    blocks.reserve({"a": 8, "b": 12})
    a, b = list(blocks.table("a")), list(blocks.table("b"))
    assert sorted(a + b) == [0, 1, 2, 3, 4] and blocks.num_free == 0
    with pytest.raises(KVCacheFull, match="need 1 more KV blocks for 1 sequence"):
        blocks.reserve({"a": 9})
    blocks.free("a")
    blocks.add("c")
    blocks.reserve({"c": 8})
    assert sorted(blocks.table("c")) == sorted(a)
    blocks.check()


def test_reserve_is_all_or_nothing() -> None:
    cache = _cache(num_blocks=4, block_size=4)
    cache.add("a")
    cache.add("b")
    _append(cache, "a", [-1, 0, 1, 2, 3])  # 2 blocks
    with pytest.raises(KVCacheFull):
        cache.reserve({"a": 3, "b": 9})  # a needs 0 more, b needs 3: 3 > 2 free
    assert cache.blocks.num_free == 2 and cache.get("b").block_table == []
    cache.reserve({"a": 3, "b": 8})
    assert cache.blocks.num_free == 0


def test_commit_moves_kept_chain_down() -> None:
    cache = _cache()
    cache.add("s")
    _append(cache, "s", [-1, 0, 1])  # prefix of 3
    cache.commit("s", [0, 1, 2])
    # Tree: 0 root; 1, 2 children of 0; 3 child of 2; 4 child of 1.
    _append(cache, "s", [-1, 0, 0, 2, 1])
    seq = cache.get("s")
    slots = torch.from_numpy(seq.slots(0, seq.total_len, cache.block_size))
    marks = torch.arange(seq.total_len, dtype=torch.float32)  # value = logical position
    cache.storage.k[:, slots] = marks[None, :, None, None]
    cache.storage.v[:, slots] = -marks[None, :, None, None]
    cache.commit("s", [0, 2, 3])
    seq = cache.get("s")
    assert (seq.committed, seq.scratch_len) == (6, 0)
    got = cache.storage.k[:, torch.from_numpy(seq.slots(0, 6, cache.block_size))][..., 0, 0]
    want = torch.tensor([0, 1, 2, 3, 5, 6], dtype=torch.float32)  # 3 + scratch [0, 2, 3]
    assert torch.equal(got, want.expand(2, 6))
    gotv = cache.storage.v[:, torch.from_numpy(seq.slots(0, 6, cache.block_size))][..., 0, 0]
    assert torch.equal(gotv, -want.expand(2, 6))
    assert len(seq.block_table) == 2  # 6 tokens in blocks of 4: the third block went back


def test_commit_rejects_non_chains() -> None:
    cache = _cache()
    cache.add("s")
    _append(cache, "s", [-1, 0, 0])
    for keep in ([1], [0, 2, 1], [0, 3], [0, 0]):
        with pytest.raises(ValueError, match="commit"):
            cache.commit("s", keep)
    assert cache.get("s").scratch_len == 3
    cache.commit("s", [])  # dropping all scratch is fine
    assert cache.get("s").total_len == 0


def test_scratch_ancestry_and_depths() -> None:
    cache = _cache()
    cache.add("s")
    _append(cache, "s", [-1, 0, 0])
    _append(cache, "s", [2, 3, 1])  # nodes 3 (under 2), 4 (under 3), 5 (under 1)
    seq = cache.get("s")
    assert seq.depths == [0, 1, 1, 2, 3, 2]
    assert np.flatnonzero(seq.ancestors[4]).tolist() == [0, 2, 3, 4]
    assert np.flatnonzero(seq.ancestors[5]).tolist() == [0, 1, 5]


def test_random_cycles_leave_no_leaks() -> None:
    rng = np.random.default_rng(0)
    cache = _cache(num_blocks=64, block_size=4)
    live: set[str] = set()
    for step in range(400):
        op = rng.integers(0, 4)
        if op == 0 or not live:
            sid = f"r{step}"
            cache.add(sid)
            live.add(sid)
            try:
                _append(cache, sid, list(range(-1, int(rng.integers(1, 20)) - 1)))
                cache.commit(sid, range(cache.get(sid).scratch_len))
            except KVCacheFull:
                pass
        elif op == 3:
            sid = sorted(live)[rng.integers(0, len(live))]
            cache.free(sid)
            live.discard(sid)
        else:  # a speculative round: random tree, keep a random root chain
            sid = sorted(live)[rng.integers(0, len(live))]
            n = int(rng.integers(1, 12))
            parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
            try:
                _append(cache, sid, parents)
            except KVCacheFull:
                continue
            chain = [0]
            while rng.random() < 0.7:
                kids = [i for i, p in enumerate(parents) if p == chain[-1]]
                if not kids:
                    break
                chain.append(int(rng.choice(kids)))
            cache.commit(sid, chain)
        used = sum(len(cache.get(s).block_table) for s in live)
        assert used + cache.blocks.num_free == 64
        for s in live:
            assert len(cache.get(s).block_table) == cache.blocks_for(cache.get(s).total_len)
    for sid in list(live):
        cache.free(sid)
    assert cache.blocks.num_free == 64 and cache.usage() == 0.0
    cache.blocks.check()
