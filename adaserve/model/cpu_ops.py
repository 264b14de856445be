"""Tree attention and RMSNorm for fp32 CPU models through adaserve's CPU library
(csrc/cpu_ops.cpp, built with the packed GEMM: cpu_gemm.py).

With the linear layers on the packed kernel, a 135M model's decode step on 2 cores
spent a quarter of its time in the ~30 small torch ops per layer around them (~5-10
us of dispatch each, whatever the size): a layer's attention was ~250 us of gather,
reshapes and SDPA, an RMSNorm ~60 us. Here each is one call.

`CpuTreeBackend` runs every query of a forward (decode steps, tree verifications,
draft steps and prompt chunks alike) through one kernel, whose output for a query is
a function of its own q and the keys it may see, in position order, and of nothing
else: not the other queries of the call, their number or their sequences, nor keys
it may not see. So a position's hidden state is the same bits whether it was
computed in a prompt chunk of any length, alone as a decode step, as a tree node, or
recomputed after a preemption or beside a prefix-cache hit, and greedy speculation
stays token-for-token lossless even where one ulp matters (int8 activations round
each hidden state per 32 features: `model.stored_activations`). Prompt chunks used to
go to torch's SDPA, whose blocking over queries changes a row's bits with the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from adaserve.model.attention import AttentionBatch
from adaserve.model.cpu_gemm import _threads, kernel
from adaserve.model.kv_cache import KVStorage

MAX_GROUP = 16  # query heads per KV head (csrc/cpu_ops.cpp kMaxGroup)
MAX_HEAD_DIM = 256
LANES = 16  # head_dim and hidden sizes a multiple of this suit both builds


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    group = num_heads // num_kv_heads
    return (
        group * num_kv_heads == num_heads
        and group <= MAX_GROUP
        and head_dim % LANES == 0
        and head_dim <= MAX_HEAD_DIM
    )


@dataclass(frozen=True)
class CpuTreeMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    q_seq: torch.Tensor  # int64 [T]: sequence of each query
    q_row: torch.Tensor  # int64 [T]: its row within that sequence's queries
    kv_slots: torch.Tensor  # int64 [B, Lmax]: cache slot of each position
    kv_len: torch.Tensor  # int64 [B]
    visible: torch.Tensor | None  # uint8 [B, Qmax, Lmax]; None: every key visible
    num_queries: int
    q_max: int
    kv_max: int

    def pointers(self) -> tuple[int | None, ...]:
        """The library's attention arguments from slot_mapping to q_max, in its order."""
        visible = None if self.visible is None else self.visible.data_ptr()
        return (
            self.slot_mapping.data_ptr(),
            self.q_seq.data_ptr(),
            self.q_row.data_ptr(),
            self.kv_slots.data_ptr(),
            self.kv_len.data_ptr(),
            self.kv_max,
            visible,
            self.q_max,
        )


class CpuTreeBackend:
    """Tree attention over the paged cache in one library call per layer (fp32 CPU)."""

    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if not supports(num_heads, num_kv_heads, head_dim):
            raise ValueError(
                f"CpuTreeBackend: {num_heads} heads / {num_kv_heads} KV heads of {head_dim}"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self._attend = kernel().adaserve_tree_attention

    def plan(self, batch: AttentionBatch) -> CpuTreeMetadata:
        t = sum(batch.query_lens)
        b = len(batch.query_lens)
        kv_max = max(len(s) for s in batch.kv_slots)
        q_max = max(batch.query_lens)
        kv_slots = np.zeros((b, kv_max), dtype=np.int64)
        for i, slots in enumerate(batch.kv_slots):
            kv_slots[i, : len(slots)] = slots
        lens = np.asarray(batch.query_lens)
        visible = None
        if not all(v.all() for v in batch.visible):
            vis = np.zeros((b, q_max, kv_max), dtype=np.uint8)
            for i, v in enumerate(batch.visible):
                vis[i, : v.shape[0], : v.shape[1]] = v
            visible = torch.from_numpy(vis)
        starts = np.cumsum(lens) - lens
        q_seq = np.repeat(np.arange(b, dtype=np.int64), lens)
        return CpuTreeMetadata(
            slot_mapping=torch.from_numpy(np.ascontiguousarray(batch.slot_mapping, np.int64)),
            q_seq=torch.from_numpy(q_seq),
            q_row=torch.from_numpy(np.arange(t, dtype=np.int64) - np.repeat(starts, lens)),
            kv_slots=torch.from_numpy(kv_slots),
            kv_len=torch.from_numpy(np.array([len(s) for s in batch.kv_slots], dtype=np.int64)),
            visible=visible,
            num_queries=t,
            q_max=q_max,
            kv_max=kv_max,
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv_new: torch.Tensor,
        kv: KVStorage,
        meta: CpuTreeMetadata,
    ) -> torch.Tensor:
        t, h, d = q.shape
        # q and kv_new are views into one [T, (H + 2 Hkv) * D] qkv row: pass its stride.
        if q.stride()[1:] != (d, 1) or kv_new.stride()[1:] != (self.num_kv_heads * d, d, 1):
            q, kv_new = q.contiguous(), kv_new.contiguous()
        cache = kv.kv[layer]
        out = torch.empty(t, h * d, dtype=torch.float32)
        rc = self._attend(
            q.data_ptr(),
            q.stride(0),
            t,
            h,
            d,
            cache.data_ptr(),
            self.num_kv_heads,
            kv_new.data_ptr(),
            kv_new.stride(0),
            *meta.pointers(),
            self.scale,
            out.data_ptr(),
            _threads(),
        )
        if rc != 0:  # supports() already refused these shapes at construction
            raise RuntimeError(f"adaserve_tree_attention refused its shapes (rc {rc})")
        return out


class CpuRMSNorm(nn.Module):
    """RMSNorm of fp32 [T, D] rows in one library call (D a multiple of 16)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)
        self.eps = eps
        self._norm = kernel().adaserve_rms_norm
        self._w = self.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.weight.shape[0]
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != d:
            return F.rms_norm(x, (d,), self.weight, self.eps)
        x = x.contiguous()
        y = torch.empty_like(x)
        self._norm(x.data_ptr(), x.shape[0], d, self._w, self.eps, y.data_ptr())
        return y


def swap_norms(model: nn.Module) -> int:
    """Replace every fp32 RMSNorm of a CPU model with a CpuRMSNorm, in place."""
    from adaserve.model.layers import RMSNorm

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            if (
                isinstance(child, RMSNorm)
                and w is not None
                and w.dtype == torch.float32
                and w.device.type == "cpu"
                and w.shape[0] % LANES == 0
            ):
                setattr(parent, name, CpuRMSNorm(w, child.eps))
                swapped += 1
    return swapped
