"""FlashInfer tree attention: batch prefill over the paged KV cache with a custom mask.

FlashInfer's FA2 prefill kernels are its only path that takes an arbitrary mask, so
that is the backend used: `plan` runs once per forward (the wrapper's scheduling work
happens there, on the host) and every layer's `attend` reuses it.

The mask FlashInfer wants is exactly `AttentionBatch.visible`: per request a row-major
[q_len, kv_len] boolean matrix over the request's *whole* KV (prefix and scratch),
concatenated over the batch. K and V are passed as strided [num_blocks, block_size,
kv_heads, head_dim] views (layout NHD) of the cache's [slots, 2, kv_heads, D].

flashinfer is an optional extra (`pip install 'adaserve[gpu]'` on a CUDA machine) and
is imported only when this backend is built. Its metadata construction
(`build_paged_arrays`) is device-free and tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from adaserve.model.attention import AttentionBatch
from adaserve.model.kv_cache import KVStorage

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class PagedArrays:
    """FlashInfer's CSR page-table description of one forward (host side, int32)."""

    qo_indptr: np.ndarray  # [B + 1]
    kv_indptr: np.ndarray  # [B + 1]: page ranges in kv_indices
    kv_indices: np.ndarray  # [pages]: block ids
    kv_last_page_len: np.ndarray  # [B]: 1..block_size
    custom_mask: np.ndarray  # bool [sum q_len * kv_len]
    slot_mapping: np.ndarray  # int64 [T]


def build_paged_arrays(batch: AttentionBatch, block_size: int) -> PagedArrays:
    """Page table and flattened mask of an `AttentionBatch`; checks that the slots really are
    `block * block_size + offset` (a mismatched block size would read wrong KV)."""
    qo, kv_ptr, pages, last, masks = [0], [0], [], [], []
    for i, (k, slots, vis, table) in enumerate(
        zip(batch.query_lens, batch.kv_slots, batch.visible, batch.block_tables, strict=True)
    ):
        length = len(slots)
        n_pages = -(-length // block_size)
        if length == 0 or n_pages > len(table):
            raise ValueError(f"sequence {i}: {length} keys but {len(table)} blocks in its table")
        used = np.asarray(table[:n_pages], dtype=np.int64)
        pos = np.arange(length)
        expect = used[pos // block_size] * block_size + pos % block_size
        if not np.array_equal(expect, np.asarray(slots, dtype=np.int64)):
            raise ValueError(
                f"sequence {i}: KV slots do not match block_size={block_size} "
                f"(is the cache's block size different?)"
            )
        if vis.shape != (k, length):
            raise ValueError(f"sequence {i}: visibility {vis.shape}, expected {(k, length)}")
        qo.append(qo[-1] + k)
        kv_ptr.append(kv_ptr[-1] + n_pages)
        pages.append(used)
        last.append(length - (n_pages - 1) * block_size)
        masks.append(np.asarray(vis, dtype=bool).reshape(-1))
    return PagedArrays(
        qo_indptr=np.asarray(qo, dtype=np.int32),
        kv_indptr=np.asarray(kv_ptr, dtype=np.int32),
        kv_indices=np.concatenate(pages).astype(np.int32),
        kv_last_page_len=np.asarray(last, dtype=np.int32),
        custom_mask=np.concatenate(masks),
        slot_mapping=np.asarray(batch.slot_mapping, dtype=np.int64),
    )


@dataclass(frozen=True)
class FlashInferMetadata:
    slot_mapping: torch.Tensor
    wrapper: Any  # the planned BatchPrefillWithPagedKVCacheWrapper


class FlashInferBackend:
    """`AttentionBackend` over flashinfer's BatchPrefillWithPagedKVCacheWrapper (FA2)."""

    name = "flashinfer"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        try:
            import flashinfer  # pyright: ignore[reportMissingImports] - the optional gpu extra
        except ImportError as exc:
            raise ImportError(
                "attention backend 'flashinfer' needs the optional extra: "
                "pip install 'adaserve[gpu]' (on a CUDA machine); or use "
                "attention_backend='triton'"
            ) from exc
        if device.type != "cuda":
            raise ValueError("attention backend 'flashinfer' needs a CUDA device")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", backend="fa2"
        )

    def plan(self, batch: AttentionBatch) -> FlashInferMetadata:
        a = build_paged_arrays(batch, self.block_size)

        def dev(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(x).to(self.device)

        # indptr arrays on the host: FlashInfer's planner reads them there anyway.
        self._wrapper.plan(
            torch.from_numpy(a.qo_indptr),
            torch.from_numpy(a.kv_indptr),
            dev(a.kv_indices),
            torch.from_numpy(a.kv_last_page_len),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            custom_mask=dev(a.custom_mask),
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        return FlashInferMetadata(slot_mapping=dev(a.slot_mapping), wrapper=self._wrapper)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv_new: torch.Tensor,
        kv: KVStorage,
        meta: FlashInferMetadata,
    ) -> torch.Tensor:
        cache = kv.kv[layer]  # [slots, 2, kv_heads, D]
        cache.index_copy_(0, meta.slot_mapping, kv_new)
        bs = self.block_size
        # K and V as strided [pages, block_size, kv_heads, D] views of the one tensor
        # (page stride 2 * block_size * kv_heads * D); FlashInfer reads page strides.
        paged = tuple(cache[:, i].unflatten(0, (-1, bs)) for i in (0, 1))
        out = meta.wrapper.run(q.contiguous(), paged)
        return out.reshape(q.shape[0], -1)
