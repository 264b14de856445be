"""Triton tree attention over the paged KV cache (the GPU backend).

One kernel serves prefill chunks, verification trees and draft steps: each new node
(query) of a sequence attends to

* the sequence's *prefix*: keys [0, prefix_len) that every query of the sequence sees
  (the committed KV plus any leading scratch nodes all queries descend from), read
  without a mask, and
* the rest, [prefix_len, kv_len): scratch nodes, read through a per-sequence bit
  matrix (query i sees key prefix_len + j iff mask[i, j]).

Keys are gathered through a per-sequence slot table (logical position -> cache slot),
so the cache may be paged with any block size. GQA: one program handles the G query
heads that share a KV head, flattened with the queries into rows (row = q * G + g),
so each K/V tile is loaded once per KV head and G need not be a power of two.

Every size the kernel loops over (kv_len, prefix_len, q_len) is read from device
memory, and the grid depends only on the number of row blocks, so a launch with fixed
buffer shapes can be captured in a CUDA graph and replayed with new contents
(`TritonMetadata.fill` rewrites them in place).

The metadata is built on the host with numpy; `build_arrays` is device-free and
tested on CPU. The kernel itself needs CUDA, or Triton's CPU interpreter: with
TRITON_INTERPRET=1 set before triton is imported, the same kernel runs on CPU tensors
(slowly), which is how the CPU tests check it where triton is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaserve.model.attention import AttentionBatch
from adaserve.model.kv_cache import KVStorage

BLOCK_N = 64  # keys per inner-loop tile


@dataclass(frozen=True)
class TreeArrays:
    """Host-side kernel metadata for one forward (numpy; see `build_arrays`)."""

    q_start: np.ndarray  # int32 [B]: packed index of the sequence's first query
    q_len: np.ndarray  # int32 [B]
    kv_len: np.ndarray  # int32 [B]: keys the sequence's queries may see (prefix + scratch)
    prefix_len: np.ndarray  # int32 [B]: keys every query sees (no mask needed)
    slots: np.ndarray  # int32 [B, max_kv]: cache slot of each logical position
    mask: np.ndarray  # uint8 [B, max_q, max_s]: query i sees key prefix_len + j
    prog_seq: np.ndarray  # int32 [P]: the sequence of each row block
    prog_row: np.ndarray  # int32 [P]: first row (q * G + g) of the block
    slot_mapping: np.ndarray  # int64 [T]


def prefix_length(visible: np.ndarray) -> int:
    """Leading key columns every query sees: those need no mask in the kernel."""
    if visible.shape[1] == 0:
        return 0
    cols = visible.all(axis=0)
    return int(visible.shape[1] if cols.all() else np.argmin(cols))


def build_arrays(batch: AttentionBatch, group: int, block_m: int) -> TreeArrays:
    """Turn a backend-neutral `AttentionBatch` into the kernel's arrays."""
    b = len(batch.query_lens)
    q_len = np.asarray(batch.query_lens, dtype=np.int32)
    kv_len = np.asarray([len(s) for s in batch.kv_slots], dtype=np.int32)
    prefix = np.asarray([prefix_length(v) for v in batch.visible], dtype=np.int32)
    max_q = int(q_len.max())
    max_s = max(1, int((kv_len - prefix).max()))
    slots = np.zeros((b, max(1, int(kv_len.max()))), dtype=np.int32)
    mask = np.zeros((b, max_q, max_s), dtype=np.uint8)
    prog_seq, prog_row = [], []
    for i, (k, s, vis) in enumerate(zip(q_len, batch.kv_slots, batch.visible, strict=True)):
        if vis.shape != (k, len(s)):
            raise ValueError(
                f"AttentionBatch: sequence {i} visibility is {vis.shape}, expected {(int(k), len(s))}"
            )
        slots[i, : len(s)] = s
        mask[i, :k, : len(s) - prefix[i]] = vis[:, prefix[i] :]
        rows = int(k) * group
        starts = np.arange(0, rows, block_m, dtype=np.int32)
        prog_seq.append(np.full(len(starts), i, dtype=np.int32))
        prog_row.append(starts)
    q_start = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int32)
    return TreeArrays(
        q_start=q_start,
        q_len=q_len,
        kv_len=kv_len,
        prefix_len=prefix,
        slots=slots,
        mask=mask,
        prog_seq=np.concatenate(prog_seq),
        prog_row=np.concatenate(prog_row),
        slot_mapping=np.asarray(batch.slot_mapping, dtype=np.int64),
    )


def reference_from_arrays(
    arrays: TreeArrays, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """The kernel's function written as plain loops over sequences (float64): the
    oracle for the metadata, independent of the reference backend's batching."""
    t, h, d = q.shape
    hk = k_cache.shape[1]
    g = h // hk
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for i in range(len(arrays.q_len)):
        k, length, p = int(arrays.q_len[i]), int(arrays.kv_len[i]), int(arrays.prefix_len[i])
        s0 = int(arrays.q_start[i])
        slots = torch.from_numpy(arrays.slots[i, :length].astype(np.int64))
        keys = k_cache.index_select(0, slots).double().repeat_interleave(g, dim=1)  # [L, H, D]
        vals = v_cache.index_select(0, slots).double().repeat_interleave(g, dim=1)
        vis = np.ones((k, length), dtype=bool)
        vis[:, p:] = arrays.mask[i, :k, : length - p].astype(bool)
        scores = torch.einsum("qhd,khd->hqk", q[s0 : s0 + k].double(), keys) * scale
        scores = scores.masked_fill(~torch.from_numpy(vis)[None], float("-inf"))
        out[s0 : s0 + k] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
    return out.reshape(t, h * d)


# ---- the kernel (defined only where triton imports) ----------------------------------

try:  # triton is optional: CPU installs do not have it
    import triton  # pyright: ignore[reportMissingImports] - an optional GPU dependency
    import triton.language as tl  # pyright: ignore[reportMissingImports]

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    HAVE_TRITON = False

if HAVE_TRITON:

    @triton.jit
    def _tree_attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        q_start_ptr,
        q_len_ptr,
        kv_len_ptr,
        prefix_ptr,
        slots_ptr,
        mask_ptr,
        prog_seq_ptr,
        prog_row_ptr,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_ot,
        slots_stride,
        mask_stride_b,
        mask_stride_q,
        qk_scale,  # softmax scale * log2(e): exp2 below
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(prog_seq_ptr + pid)
        row0 = tl.load(prog_row_ptr + pid)
        q0 = tl.load(q_start_ptr + seq)
        qn = tl.load(q_len_ptr + seq)
        kv_len = tl.load(kv_len_ptr + seq)
        prefix = tl.load(prefix_ptr + seq)

        rows = row0 + tl.arange(0, BLOCK_M)
        qi = rows // GROUP  # query within the sequence
        head = kvh * GROUP + rows % GROUP
        row_ok = qi < qn
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_off = (q0 + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # A finite start: rows that have seen only masked keys get exp2(-inf - m) = 0,
        # never NaN from (-inf) - (-inf).
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        cols = tl.arange(0, BLOCK_N)
        slot_row = slots_ptr + seq.to(tl.int64) * slots_stride
        mask_row = mask_ptr + seq.to(tl.int64) * mask_stride_b + qi[:, None] * mask_stride_q

        for start in range(0, kv_len, BLOCK_N):
            pos = start + cols
            pos_ok = pos < kv_len
            slot = tl.load(slot_row + pos, mask=pos_ok, other=0).to(tl.int64)
            kd_ok = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=kd_ok,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            # Prefix keys are visible to every row; the rest go through the mask bits
            # (loaded only for tiles that reach past the prefix).
            visible = row_ok[:, None] & (pos_ok & (pos < prefix))[None, :]
            if start + BLOCK_N > prefix:
                tree = (pos >= prefix) & pos_ok
                bits = tl.load(
                    mask_row + (pos - prefix)[None, :],
                    mask=row_ok[:, None] & tree[None, :],
                    other=0,
                )
                visible = visible | (bits != 0)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                mask=kd_ok,
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padded rows only; never stored
        out = acc / l_i[:, None]
        o_off = (q0 + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :]
        o_ok = row_ok[:, None] & d_ok[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_ok)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def pick_block_m(max_rows: int) -> int:
    """Rows (query x head-in-group) per program: 16 is tl.dot's minimum; larger blocks
    only pay when a sequence has many rows."""
    return 16 if max_rows <= 16 else 32 if max_rows <= 64 else 64


@dataclass
class TritonMetadata:
    """Device tensors for one forward (or one captured graph: fixed shapes, rewritten
    in place by `fill`)."""

    slot_mapping: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    kv_len: torch.Tensor
    prefix_len: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    prog_seq: torch.Tensor
    prog_row: torch.Tensor
    block_m: int
    # Host copies of the shape facts a CUDA-graph wrapper needs without a device sync.
    q_lens_host: tuple[int, ...] = ()
    max_kv: int = 0  # longest kv_len of the batch
    max_tree: int = 0  # longest kv_len - prefix_len (mask columns in use)

    @staticmethod
    def from_arrays(arrays: TreeArrays, block_m: int, device: torch.device) -> TritonMetadata:
        def dev(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(device, non_blocking=True)

        return TritonMetadata(
            slot_mapping=dev(arrays.slot_mapping),
            q_start=dev(arrays.q_start),
            q_len=dev(arrays.q_len),
            kv_len=dev(arrays.kv_len),
            prefix_len=dev(arrays.prefix_len),
            slots=dev(arrays.slots),
            mask=dev(arrays.mask),
            prog_seq=dev(arrays.prog_seq),
            prog_row=dev(arrays.prog_row),
            block_m=block_m,
            q_lens_host=tuple(int(x) for x in arrays.q_len),
            max_kv=int(arrays.kv_len.max()),
            max_tree=int((arrays.kv_len - arrays.prefix_len).max()),
        )


class TritonBackend:
    """`AttentionBackend` running the Triton tree-attention kernel (CUDA)."""

    name = "triton"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
    ) -> None:
        if not HAVE_TRITON:
            raise ImportError(
                "attention backend 'triton' needs the triton package (it ships with CUDA "
                "builds of PyTorch)"
            )
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads not divisible by {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.device = device

    def plan(self, batch: AttentionBatch) -> TritonMetadata:
        block_m = pick_block_m(max(batch.query_lens) * self.group)
        arrays = build_arrays(batch, self.group, block_m)
        return TritonMetadata.from_arrays(arrays, block_m, self.device)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv_new: torch.Tensor,
        kv: KVStorage,
        meta: TritonMetadata,
    ) -> torch.Tensor:
        cache = kv.kv[layer]  # [slots, 2, kv_heads, D]
        cache.index_copy_(0, meta.slot_mapping, kv_new)
        return tree_attention(q, cache[:, 0], cache[:, 1], meta, self.group, self.scale)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TritonMetadata,
    group: int,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] and the caches [S, Hkv, D] may be strided views (unit stride along
    D), e.g. K and V halves of the cache's [S, 2, Hkv, D]. Returns [T, H * D] in
    packed token order."""
    t, h, d = q.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("tree_attention: the head dimension must be contiguous")
    out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)
    grid = (meta.prog_seq.shape[0], k_cache.shape[1])
    # triton.jit makes a subscriptable JITFunction; without triton installed the checker
    # sees the plain function.
    _tree_attn_kernel[grid](  # pyright: ignore[reportIndexIssue]
        q,
        k_cache,
        v_cache,
        out,
        meta.q_start,
        meta.q_len,
        meta.kv_len,
        meta.prefix_len,
        meta.slots,
        meta.mask,
        meta.prog_seq,
        meta.prog_row,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        meta.slots.stride(0),
        meta.mask.stride(0),
        meta.mask.stride(1),
        scale * 1.4426950408889634,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=max(16, _next_pow2(d)),  # tl.dot needs K >= 16: tiny heads are padded (masked)
        BLOCK_M=meta.block_m,
        BLOCK_N=BLOCK_N,
        # fp32 caches mean "exact": tl.dot would otherwise round fp32 inputs to TF32 on
        # Ampere+ (1e-3 relative error on an H100); half precision takes its own path
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
