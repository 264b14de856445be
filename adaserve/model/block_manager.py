"""KV blocks on demand, shared by prefix: the block accounting of a paged KV cache.

Torch-free, so the real cache (`kv_cache.PagedKVCache`) and the simulator's modelled
target use the same code. A sequence holds blocks for the tokens it has committed plus
its current scratch; nothing is reserved ahead.

Automatic prefix caching (vLLM's scheme): a block, once full of committed tokens, is
identified by a hash chained over its tokens and those of every block before it, and
entered in an index. A new sequence takes the longest run of indexed blocks matching
the start of its tokens, referencing them instead of computing their KV again. Blocks
are reference-counted; a block nobody references stays indexed and goes to the tail of
an LRU free queue, and is only reused (and dropped from the index) when a fresh block is
needed and no never-indexed free block is left, the least recently used first. The
chain hash is BLAKE2b over the previous block's digest and this block's token ids, so
equal digests mean equal prefixes (a collision would need a 128-bit one).

The KV of a full, shared block is never written again: a sequence only writes at
positions at or beyond its committed length, which lie in blocks it alone holds.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class KVCacheFull(RuntimeError):
    """Not enough free KV blocks for the request; nothing was changed."""


@dataclass
class _Seq:
    table: list[int] = field(default_factory=list)  # block ids, position order
    tokens: list[int] = field(default_factory=list)  # committed token ids
    digests: list[bytes] = field(default_factory=list)  # chain hash of each full block


@dataclass
class CacheStats:
    """Prefix-cache lookups, in tokens (vLLM's prefix_cache_queries / _hits)."""

    queries: int = 0
    hits: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need positive num_blocks and block_size, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        # Free blocks never indexed (or dropped from the index), LIFO so recently freed,
        # cache-warm blocks come back first; and indexed blocks nobody holds, in LRU order.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index: dict[bytes, int] = {}  # chain digest -> block
        self._digest: dict[int, bytes] = {}  # block -> its digest, while indexed
        self.seqs: dict[str, _Seq] = {}
        self.stats = CacheStats()

    # -- capacity --------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks a reservation can take now (indexed ones nobody holds included)."""
        return len(self._free) + len(self._evictable)

    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free ones count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, lengths: dict[str, int]) -> int:
        """New blocks the sequences need to hold `lengths[id]` tokens each (total)."""
        return sum(
            max(0, self.blocks_for(n) - len(self.seqs[sid].table)) for sid, n in lengths.items()
        )

    # -- sequences -------------------------------------------------------------------

    def add(self, seq_id: str, tokens: Sequence[int] = (), use_cache: bool = True) -> int:
        """Start a sequence that will hold `tokens` (its prompt); returns how many of
        them are already in the cache (whole blocks, and never the last token, whose
        logits the caller still needs). Those blocks are now referenced by it.
        `use_cache` False: nothing is looked up (the caller needs every prompt row's
        logits); the blocks it fills still enter the index."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        seq = self.seqs[seq_id] = _Seq()
        if not self.prefix_caching or not tokens or not use_cache:
            return 0
        bs = self.block_size
        usable = (len(tokens) - 1) // bs  # the last token is always computed
        digest = b""
        for i in range(usable):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            digest = _chain(digest, block_tokens)
            block = self._index.get(digest)
            if block is None:
                break
            self._take(block)
            seq.table.append(block)
            seq.tokens.extend(int(t) for t in block_tokens)
            seq.digests.append(digest)
        self.stats.queries += len(tokens)
        self.stats.hits += len(seq.tokens)
        return len(seq.tokens)

    def committed(self, seq_id: str) -> int:
        return len(self.get(seq_id).tokens)

    def table(self, seq_id: str) -> list[int]:
        return self.get(seq_id).table

    def get(self, seq_id: str) -> _Seq:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (add it first)") from None

    def reserve(self, lengths: dict[str, int]) -> None:
        """Grow block tables so each sequence holds `lengths[id]` tokens in total. All or
        nothing: raises KVCacheFull before touching any table."""
        need = {sid: self.blocks_for(n) - len(self.get(sid).table) for sid, n in lengths.items()}
        total = sum(max(0, n) for n in need.values())
        if total > self.num_free:
            raise KVCacheFull(
                f"need {total} more KV blocks for {len(lengths)} sequence(s), "
                f"{self.num_free} free of {self.num_blocks}"
            )
        for sid, n in need.items():
            for _ in range(n):
                self.seqs[sid].table.append(self._fresh())

    def commit(self, seq_id: str, tokens: Sequence[int]) -> None:
        """`tokens` joined the sequence's committed prefix (their KV is in its blocks):
        every block they fill is entered in the prefix index."""
        seq = self.get(seq_id)
        seq.tokens.extend(int(t) for t in tokens)
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(seq.digests) < len(seq.tokens) // bs:
            i = len(seq.digests)
            digest = _chain(
                seq.digests[-1] if seq.digests else b"", seq.tokens[i * bs : (i + 1) * bs]
            )
            seq.digests.append(digest)
            block = seq.table[i]
            # The first copy stays indexed: a duplicate block is just held, not entered.
            if digest not in self._index and block not in self._digest:
                self._index[digest] = block
                self._digest[block] = digest

    def trim(self, seq_id: str, total_len: int) -> None:
        """Release the sequence's blocks beyond `total_len` tokens (dropped scratch)."""
        seq = self.get(seq_id)
        keep = self.blocks_for(total_len)
        if len(seq.table) > keep:
            self._release(seq.table[keep:])
            del seq.table[keep:]

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks; an unknown id is ignored (abort paths race)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            # Tail first: a sequence's last blocks are the least likely to be shared, so
            # they should be the first evicted (they enter the LRU queue first).
            self._release(seq.table[::-1])

    # -- blocks ----------------------------------------------------------------------

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            self._evictable.pop(block, None)
        self.refs[block] += 1

    def _fresh(self) -> int:
        """A block for new KV: a never-indexed free one, else the least recently used
        indexed one (dropped from the index)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._index[self._digest.pop(block)]
        self.refs[block] = 1
        return block

    def _release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise AssertionError(f"block {block} released more often than taken")
            if self.refs[block] == 0:
                if block in self._digest:
                    self._evictable[block] = None  # most recently used: evicted last
                else:
                    self._free.append(block)

    def check(self) -> None:
        """Invariants (tests): every block is held, free or evictable, exactly once;
        reference counts equal the tables' references; the index maps both ways."""
        held = np.zeros(self.num_blocks, dtype=np.int64)
        for seq in self.seqs.values():
            for block in seq.table:
                held[block] += 1
        assert np.array_equal(held, self.refs), "reference counts disagree with the tables"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not (free & evictable)
        zero = set(np.nonzero(self.refs == 0)[0].tolist())
        assert free | evictable == zero, "a block is neither held nor free"
        assert all(block in self._digest for block in evictable)
        assert all(self._index[d] == b for b, d in self._digest.items())
        assert len(self._index) == len(self._digest)


def _chain(previous: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()
