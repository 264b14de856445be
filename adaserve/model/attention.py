"""Tree attention over the paged KV cache: the batch description, the backend
interface, and the pure-PyTorch reference backend (CPU and GPU; the test oracle).

Each new node attends to its sequence's committed prefix, its scratch ancestors and
itself. The runner describes that once per forward as an `AttentionBatch`; a backend turns
it into its own metadata (`plan`) and then runs every layer with it (`attend`).
attention_setting.py picks and builds the backend that runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from adaserve.model.kv_cache import KVStorage


@dataclass(frozen=True)
class AttentionBatch:
    """The per-forward attention metadata input: backend-neutral description of one
    forward's attention pattern (not `adaserve.tree.TreeBatch`, the candidate trees)."""

    query_lens: list[int]  # new nodes per sequence
    slot_mapping: np.ndarray  # int64 [T]: cache slot for each new node's KV (packed order)
    kv_slots: list[np.ndarray]  # per sequence int64 [L_b]: slots of logical positions 0..L_b-1
    visible: list[np.ndarray]  # per sequence bool [k_b, L_b]: query i may see position j
    block_tables: list[list[int]]  # per sequence (for paged-kernel backends)
    # per sequence: its new nodes are a prompt chunk (no tree node among them); a
    # backend may pick another kernel for them. Empty: none are.
    prefill: list[bool] = field(default_factory=list)


class AttentionBackend(Protocol):
    name: str

    def plan(self, batch: AttentionBatch) -> Any:
        """Build the per-forward metadata, once, before the layers run."""

    def attend(
        self, layer: int, q: torch.Tensor, kv_new: torch.Tensor, kv: KVStorage, meta: Any
    ) -> torch.Tensor:
        """Write kv_new [T, 2, kv_heads, D] (k | v) at the new nodes' slots, then attend
        q [T, heads, D]; returns [T, heads * D] in packed token order."""
        ...


@dataclass(frozen=True)
class ReferenceMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    kv_gather: torch.Tensor  # int64 [B * L]: cache slots, padded with slot 0
    q_gather: torch.Tensor | None  # int64 [B * Q]: packed index of each padded query row
    out_gather: torch.Tensor | None  # int64 [T]: padded row of each packed token
    mask: torch.Tensor | None  # bool [B, 1, G * Q, L]; None: every query sees every key
    batch: int
    q_max: int
    kv_max: int


class ReferenceBackend:
    """Gather each sequence's KV into a padded [B, kv_heads, L, D] tensor and run one
    SDPA for the whole batch, so the op count per layer does not grow with B.

    GQA without repeating KV: the G query heads sharing a KV head are folded into
    the query-length axis ([B, kv_heads, G * Q, D]), and the mask repeated G times."""

    name = "reference"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.device = device

    def plan(self, batch: AttentionBatch) -> ReferenceMetadata:
        b = len(batch.query_lens)
        q_max = max(batch.query_lens)
        kv_max = max(len(s) for s in batch.kv_slots)
        gather = np.zeros((b, kv_max), dtype=np.int64)
        mask = np.zeros((b, q_max, kv_max), dtype=bool)
        mask[:, :, 0] = True  # padded query rows see one key: no all-masked NaN rows
        q_gather = np.zeros((b, q_max), dtype=np.int64)
        out_gather = np.empty(sum(batch.query_lens), dtype=np.int64)
        t = 0
        for i, (k, slots, vis) in enumerate(
            zip(batch.query_lens, batch.kv_slots, batch.visible, strict=True)
        ):
            gather[i, : len(slots)] = slots
            mask[i, :k, :] = False
            mask[i, :k, : len(slots)] = vis
            q_gather[i, :k] = np.arange(t, t + k)
            out_gather[t : t + k] = i * q_max + np.arange(k)
            t += k
        dev = self.device
        all_visible = b == 1 and bool(mask.all())
        mask_t = None
        if not all_visible:
            m = torch.from_numpy(mask).to(dev)
            mask_t = m[:, None, None].expand(b, 1, self.group, q_max, kv_max)
            mask_t = mask_t.reshape(b, 1, self.group * q_max, kv_max)
        padded = b > 1 and not all(k == q_max for k in batch.query_lens)
        return ReferenceMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(dev),
            kv_gather=torch.from_numpy(gather.reshape(-1)).to(dev),
            q_gather=torch.from_numpy(q_gather.reshape(-1)).to(dev) if padded else None,
            out_gather=torch.from_numpy(out_gather).to(dev) if padded else None,
            mask=mask_t,
            batch=b,
            q_max=q_max,
            kv_max=kv_max,
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv_new: torch.Tensor,
        kv: KVStorage,
        meta: ReferenceMetadata,
    ) -> torch.Tensor:
        cache = kv.kv[layer]  # [slots, 2, kv_heads, D]
        cache.index_copy_(0, meta.slot_mapping, kv_new)
        b, qn, ln = meta.batch, meta.q_max, meta.kv_max
        hk, g, d = self.num_kv_heads, self.group, self.head_dim
        ctx = cache.index_select(0, meta.kv_gather).view(b, ln, 2, hk, d)
        keys, values = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)
        if meta.q_gather is not None:
            q = q.index_select(0, meta.q_gather)
        # [B*Q, H, D] -> [B, Hkv, G*Q, D]; head h = kv_head * G + g (HF's repeat_kv order)
        q = q.view(b, qn, hk, g, d).permute(0, 2, 3, 1, 4).reshape(b, hk, g * qn, d)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.mask, scale=self.scale)
        out = out.view(b, hk, g, qn, d).permute(0, 3, 1, 2, 4).reshape(b * qn, hk * g * d)
        if meta.out_gather is not None:
            out = out.index_select(0, meta.out_gather)
        return out
