"""Paged KV cache: a block allocator, per-sequence block tables, and the KV tensors.

A sequence's logical positions 0..L-1 map to cache slots through its block table:
`slot(p) = table[p // block_size] * block_size + p % block_size`. Positions
`[0, committed)` hold committed KV; scratch node `s` (a speculative node of the
current iteration) lives at logical position `committed + s`. Committing a chain
moves the kept nodes' KV down to `committed, committed + 1, ...` and frees the
blocks the sequence no longer needs.

Block accounting (on-demand allocation, reference counts, automatic prefix caching)
lives in `block_manager.BlockManager`, which uses no torch, so it can be tested (and
reasoned about) apart from the tensors and the simulator shares it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from adaserve.model.block_manager import BlockManager, KVCacheFull

__all__ = ["BlockManager", "KVCacheFull", "KVStorage", "PagedKVCache", "SequenceState"]


@dataclass
class SequenceState:
    """One sequence's cache bookkeeping: committed length, block table (the block
    manager's list, shared) and scratch tree."""

    block_table: list[int] = field(default_factory=list)
    committed: int = 0
    # Scratch nodes of the current iteration, in append order.
    tokens: list[int] = field(default_factory=list)  # their token ids
    parents: list[int] = field(default_factory=list)  # -1 = child of the committed prefix
    depths: list[int] = field(default_factory=list)  # 0 for a child of the prefix
    # ancestors[i, j]: scratch node j is node i or one of its ancestors. [S, S]
    ancestors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))

    @property
    def scratch_len(self) -> int:
        return len(self.parents)

    @property
    def total_len(self) -> int:
        return self.committed + len(self.parents)

    def slots(self, start: int, stop: int, block_size: int) -> np.ndarray:
        """Cache slots of logical positions [start, stop). int64 [stop - start]"""
        pos = np.arange(start, stop, dtype=np.int64)
        table = np.asarray(self.block_table, dtype=np.int64)
        return table[pos // block_size] * block_size + pos % block_size

    def append_scratch(
        self, parents: np.ndarray, tokens: Sequence[int] | np.ndarray = ()
    ) -> np.ndarray:
        """Append new scratch nodes (validated by the caller); returns their depths."""
        s0, k = self.scratch_len, len(parents)
        # Token ids key the prefix cache once committed; -1 where a caller has none.
        self.tokens.extend([int(t) for t in tokens] if len(tokens) else [-1] * k)
        anc = np.zeros((s0 + k, s0 + k), dtype=bool)
        anc[:s0, :s0] = self.ancestors
        for j, p in enumerate(parents.tolist()):
            i = s0 + j
            if p >= 0:
                anc[i] = anc[p]
                self.depths.append(self.depths[p] + 1)
            else:
                self.depths.append(0)
            anc[i, i] = True
            self.parents.append(p)
        self.ancestors = anc
        return np.asarray(self.depths[s0:], dtype=np.int64)

    def clear_scratch(self) -> None:
        self.tokens, self.parents, self.depths = [], [], []
        self.ancestors = np.zeros((0, 0), dtype=bool)


class KVStorage:
    """K and V together: kv [num_layers, num_blocks * block_size, 2, kv_heads, head_dim].

    One slot axis shared by all layers, so a commit moves every layer's KV with one
    indexed copy; K and V side by side in a slot, so a layer writes and gathers both
    with one op each (op count is what a small model's CPU step pays for)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_blocks * block_size, 2, kv_heads, head_dim)
        # empty, not zeros: untouched pages cost no memory. Every slot is written before
        # it is read, except slot 0, which the reference backend gathers as padding and
        # masks out; it must hold finite numbers (0 * NaN would leak through softmax).
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.kv[:, 0].zero_()

    @property
    def k(self) -> torch.Tensor:
        """[num_layers, slots, kv_heads, head_dim] view."""
        return self.kv[:, :, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, :, 1]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst in every layer. The right side is gathered before the
        write, so overlapping src/dst (dst <= src along a chain) is safe."""
        self.kv[:, dst] = self.kv[:, src]


class PagedKVCache:
    """Block accounting (a `BlockManager`) plus storage for a set of sequences."""

    def __init__(
        self, storage: KVStorage, num_blocks: int, block_size: int, prefix_caching: bool = True
    ) -> None:
        self.storage = storage
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.seqs: dict[str, SequenceState] = {}

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.blocks.blocks_for(num_tokens)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.blocks.num_free

    def usage(self) -> float:
        return self.blocks.usage()

    def add(self, seq_id: str, tokens: Sequence[int] = (), use_cache: bool = True) -> int:
        """A new sequence that will hold `tokens`: returns how many of them are cached
        already (their KV is committed from the start; the caller computes the rest).
        `use_cache` False: none (the prefix cache is not looked up)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        cached = self.blocks.add(seq_id, tokens, use_cache)
        self.seqs[seq_id] = SequenceState(block_table=self.blocks.table(seq_id), committed=cached)
        return cached

    def get(self, seq_id: str) -> SequenceState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (add_sequence first)") from None

    def reserve(self, growth: dict[str, int]) -> None:
        """Grow block tables so each sequence can hold `growth[id]` more tokens.
        All or nothing: raises KVCacheFull before touching any table."""
        self.blocks.reserve({sid: self.get(sid).total_len + n for sid, n in growth.items()})

    def commit(self, seq_id: str, keep: list[int]) -> None:
        seq = self.get(seq_id)
        _check_chain(seq, keep, seq_id)
        c = seq.committed
        moved = [(c + s, c + i) for i, s in enumerate(keep) if s != i]
        if moved:
            src, dst = (list(t) for t in zip(*moved, strict=True))
            slots = torch.from_numpy(seq.slots(0, seq.total_len, self.block_size))
            slots = slots.to(self.storage.kv.device)
            self.storage.move(slots[src], slots[dst])
        self.blocks.commit(seq_id, [seq.tokens[s] for s in keep])
        seq.committed = c + len(keep)
        seq.clear_scratch()
        self.blocks.trim(seq_id, seq.total_len)

    def free(self, seq_id: str) -> None:
        if self.seqs.pop(seq_id, None) is not None:
            self.blocks.free(seq_id)


def _check_chain(seq: SequenceState, keep: list[int], seq_id: str) -> None:
    prev = -1
    for s in keep:
        if not 0 <= s < seq.scratch_len:
            raise ValueError(
                f"commit({seq_id!r}): scratch index {s} out of range [0, {seq.scratch_len})"
            )
        if seq.parents[s] != prev:
            raise ValueError(
                f"commit({seq_id!r}): keep={keep} is not a chain from the committed prefix "
                f"(node {s} has parent {seq.parents[s]}, expected {prev})"
            )
        prev = s
