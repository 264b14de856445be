"""KV blocks on demand and the prefix cache (adaserve/model/block_manager.py, no torch):
reference counts never leak over thousands of random admit / grow / commit / preempt /
finish / abort sequences, hits are exactly the longest cached run of whole blocks,
never the last prompt token, and freed cached blocks are evicted least recently used
first, only when space is needed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.model.block_manager import BlockManager, KVCacheFull


def grow_and_commit(bm: BlockManager, sid: str, tokens: list[int]) -> None:
    bm.reserve({sid: bm.committed(sid) + len(tokens)})
    bm.commit(sid, tokens)


def test_a_shared_prompt_is_served_from_the_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert bm.add("a", [*system, 1, 2, 3]) == 0
    grow_and_commit(bm, "a", [*system, 1, 2, 3])
    # The same 10-token start: its two full blocks are found, the partial third is not.
    assert bm.add("b", [*system, 7, 8]) == 8
    assert bm.table("b")[:2] == bm.table("a")[:2]
    assert bm.refs[bm.table("a")[0]] == 2
    # A prompt equal to cached blocks still recomputes its last token (its logits are
    # needed): 8 cached tokens of a 8-token prompt give 4.
    assert bm.add("c", system[:8]) == 4
    assert bm.stats.queries == 13 + 12 + 8 and bm.stats.hits == 8 + 4
    bm.check()


def test_a_different_token_anywhere_before_breaks_the_chain() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.add("a")
    grow_and_commit(bm, "a", list(range(12)))
    bm.add("x", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert bm.committed("x") == 12
    bm.add("y", [0, 1, 2, 99, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # first block differs
    assert bm.committed("y") == 0
    bm.add("z", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])  # the second
    assert bm.committed("z") == 4


def test_freed_cached_blocks_are_evicted_lru_and_only_when_needed() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, prefix_caching=True)
    for sid, base in (("old", 0), ("new", 50)):
        bm.add(sid)
        grow_and_commit(bm, sid, [base + i for i in range(4)])  # 2 full blocks each
        bm.free(sid)
    assert bm.num_free == 6 and bm.usage() == 0.0  # cached blocks count as free
    assert bm.add("again", [50, 51, 52, 53, 54]) == 4  # still cached after the free
    bm.free("again")
    # Two fresh blocks: the 2 never-indexed ones go first, nothing evicted yet.
    bm.add("p")
    bm.reserve({"p": 4})
    assert bm.add("q", [0, 1, 2, 3, 9]) == 4  # a hit on "old": now the most recent
    bm.free("q")
    # Two more must come from the cache: "new" (used least recently) is evicted...
    bm.reserve({"p": 8})
    assert bm.add("s", [50, 51, 52, 53, 9]) == 0
    assert bm.add("r", [0, 1, 2, 3, 9]) == 4  # ... while "old" survives
    bm.check()


def test_prefix_caching_off_shares_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, prefix_caching=False)
    assert bm.add("a", [1, 2, 3, 4]) == 0
    grow_and_commit(bm, "a", [1, 2, 3, 4])
    assert bm.add("b", [1, 2, 3, 4, 5]) == 0
    bm.free("a")
    assert bm.num_free == 8 - len(bm.table("b"))


def test_reserve_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.add("a")
    bm.add("b")
    with pytest.raises(KVCacheFull):
        bm.reserve({"a": 8, "b": 12})
    assert bm.table("a") == [] and bm.table("b") == [] and bm.num_free == 4


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_no_block_leaks_under_random_lifecycles(seed: int, prefix_caching: bool) -> None:
    """Thousands of random operations as the engine issues them: admit (with a prompt
    drawn from a few shared starts), grow and commit (prefill chunks, accepted trees),
    drop scratch, preempt (free, re-add the same tokens), finish and abort. After every
    one the counts agree with the tables; at the end everything is free."""
    rng = np.random.default_rng(seed)
    bm = BlockManager(num_blocks=48, block_size=4, prefix_caching=prefix_caching)
    starts = [list(rng.integers(0, 50, size=int(rng.integers(1, 20)))) for _ in range(4)]
    live: dict[str, list[int]] = {}  # id -> the tokens it holds (committed)
    n_ids = 0
    for _ in range(300):
        op = rng.integers(0, 6)
        if op == 0 or not live:  # admit
            sid = f"s{n_ids}"
            n_ids += 1
            prompt = starts[rng.integers(0, 4)] + list(
                rng.integers(0, 50, size=int(rng.integers(1, 9)))
            )
            cached = bm.add(sid, [int(t) for t in prompt])
            assert cached < len(prompt) and cached % bm.block_size == 0
            assert bm.table(sid) == bm.table(sid)[: cached // bm.block_size]
            live[sid] = [int(t) for t in prompt[:cached]]
            continue
        sid = sorted(live)[rng.integers(0, len(live))]
        if op in (1, 2):  # grow by a chunk or a tree, commit part of it, drop the rest
            k = int(rng.integers(1, 10))
            try:
                bm.reserve({sid: bm.committed(sid) + k})
            except KVCacheFull:
                continue
            keep = [int(t) for t in rng.integers(0, 50, size=int(rng.integers(0, k + 1)))]
            bm.commit(sid, keep)
            bm.trim(sid, bm.committed(sid))
            live[sid] += keep
        elif op == 3:  # preempt: free, then come back with the same tokens
            tokens = live[sid]
            bm.free(sid)
            cached = bm.add(sid, [*tokens, 7])
            if prefix_caching:
                assert cached >= 0
            live[sid] = tokens[:cached]
        else:  # finish or abort
            bm.free(sid)
            del live[sid]
        bm.check()
        for s, tokens in live.items():
            assert bm.committed(s) == len(tokens)
            assert len(bm.table(s)) >= bm.blocks_for(len(tokens))
    for sid in list(live):
        bm.free(sid)
    bm.check()
    assert bm.num_free == bm.num_blocks and bm.usage() == 0.0
    assert int(bm.refs.sum()) == 0
