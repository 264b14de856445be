"""Paged KV cache: a block allocator, per-sequence block tables, and the KV tensors.

A sequence's logical positions 0..L-1 map to cache slots through its block table:
`slot(p) = table[p // block_size] * block_size + p % block_size`. Positions
`[0, committed)` hold committed KV; scratch node `s` (a speculative node of the
current iteration) lives at logical position `committed + s`. Committing a chain
moves the kept nodes' KV down to `committed, committed + 1, ...` and frees the
blocks the sequence no longer needs.

The allocator and block tables use no torch, so they can be tested (and reasoned
about) apart from the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class KVCacheFull(RuntimeError):
    """Not enough free KV blocks for the request; nothing was changed."""


class BlockAllocator:
    """A free list of block ids. LIFO so recently freed (cache-warm) blocks come back
    first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFull(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        out = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return out

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class SequenceState:
    """One sequence's cache bookkeeping: committed length, block table and scratch tree."""

    block_table: list[int] = field(default_factory=list)
    committed: int = 0
    # Scratch nodes of the current iteration, in append order.
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

    def append_scratch(self, parents: np.ndarray) -> np.ndarray:
        """Append new scratch nodes (validated by the caller); returns their depths."""
        s0, k = self.scratch_len, len(parents)
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
        self.parents, self.depths = [], []
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
    """Block accounting plus storage for a set of sequences."""

    def __init__(self, storage: KVStorage, num_blocks: int, block_size: int) -> None:
        self.storage = storage
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.seqs: dict[str, SequenceState] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.allocator.num_free

    def usage(self) -> float:
        a = self.allocator
        return (a.num_blocks - a.num_free) / a.num_blocks

    def add(self, seq_id: str) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self.seqs[seq_id] = SequenceState()

    def get(self, seq_id: str) -> SequenceState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (add_sequence first)") from None

    def reserve(self, growth: dict[str, int]) -> None:
        """Grow block tables so each sequence can hold `growth[id]` more tokens.
        All or nothing: raises KVCacheFull before touching any table."""
        need = {
            sid: self.blocks_for(self.seqs[sid].total_len + n) - len(self.seqs[sid].block_table)
            for sid, n in growth.items()
        }
        total = sum(max(0, n) for n in need.values())
        if total > self.allocator.num_free:
            raise KVCacheFull(
                f"need {total} more KV blocks for {len(growth)} sequence(s), "
                f"{self.allocator.num_free} free of {self.allocator.num_blocks}"
            )
        for sid, n in need.items():
            if n > 0:
                self.seqs[sid].block_table.extend(self.allocator.allocate(n))

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
        seq.committed = c + len(keep)
        seq.clear_scratch()
        self._trim(seq)

    def free(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.allocator.release(seq.block_table)

    def _trim(self, seq: SequenceState) -> None:
        keep_blocks = self.blocks_for(seq.total_len)
        if len(seq.block_table) > keep_blocks:
            self.allocator.release(seq.block_table[keep_blocks:])
            del seq.block_table[keep_blocks:]


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
