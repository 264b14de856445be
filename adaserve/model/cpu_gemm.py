"""fp32 linear layers on x86-64 CPUs through our own few-row GEMM (csrc/skinny_gemm.cpp).

On the CPU a decode step or a tree verification multiplies 1-16 token rows by every
weight of the model, so its cost is reading the weights. MKL's sgemm reads them at
full speed for one row but pays ~1.5x for the 4-8 rows of a verified tree on an Intel
AVX-512 host, and 2-3x on an AMD AVX2 one (where its one-row path is also half our
speed), which eats what speculation gains at one request. The packed kernel streams
each weight once for a few rows at a time: 5 rows cost about what 1 does, and a
256-row prefill chunk within ~10% of MKL (`benchmarks/bench_verify.py --cpu-kernel
auto mkl`).

One source builds for AVX-512 (with VNNI where the CPU has it) or for AVX2 + FMA,
whichever the CPU has (`supported_isas()`).
Each output is the same sequence of FMA chains (128 input features each, summed in
order) for any number of rows and on either build, so a token's logits do not depend
on the tree verified beside it. The result differs from MKL's in the last bits
(another summation order), as any two BLAS do.

The same kernel serves a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks as stored
(`QuantLinear`, `model.quantization: stored`, stored.py): blocks repacked at load (the
K-quants' super-blocks transcoded to 32-weight blocks with float32 scales, exactly),
dequantized exactly in registers, then the same FMA chains, so the same bits as
PackedLinear over the GGUF's dequantized weights from a sixth (Q4_1) of the bytes; or,
with activations "int8" (`model.stored_activations`), each row quantized per 32 features to int8 and
integer dot products per block (skinny_gemm.cpp's QuantI8), as llama.cpp does.

The same library holds the small per-layer ops (tree attention, RMSNorm) that
cpu_ops.py puts around these layers.

The library is compiled on first use with the system's g++ (about a second) into
~/.cache/adaserve/kernels (ADASERVE_CACHE_DIR moves it) and loaded through ctypes. The
CPU image builds both in its builder stage (`build()`) and ships them in its cache, as
it does the converted model: its runtime stage has no compiler and a read-only root.
Without g++, AVX2 or an x86 Linux host, `pack_linears` leaves the model on MKL and
says why; `cpu_kernel: mkl` (ADASERVE_MODEL__CPU_KERNEL=mkl) asks for MKL.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from adaserve.model.embedded import cache_root
from adaserve.model.layers import VocabParallelEmbedding, linear_layers
from adaserve.model.llama import LlamaModel

log = logging.getLogger("adaserve.model")

CPU_KERNELS = ("auto", "mkl")
CSRC = Path(__file__).parent / "csrc"
# One library: the GEMM, the per-layer ops beside it (cpu_ops.py) and the decoder
# layers over both (cpu_layers.py).
SOURCES = (CSRC / "skinny_gemm.cpp", CSRC / "cpu_ops.cpp", CSRC / "cpu_layers.cpp")
HEADERS = (CSRC / "simd.h",)
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# avx512vnni: the AVX-512 build with VNNI's one-instruction int8 dot products (simd.h
# idot), for the int8-activation path; the same bits as avx512's.
_AVX512 = ("-mavx512f", "-mavx512bw", "-mfma")
ISA_FLAGS = {
    "avx512vnni": (*_AVX512, "-mavx512vnni"),
    "avx512": _AVX512,
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
# torch's name for the CPU's vector capability -> our build of the kernel for it.
_TORCH_ISA = {"AVX512": "avx512", "AVX2": "avx2"}


class KernelUnavailable(RuntimeError):
    """The packed kernel cannot run here (the message says why)."""


def build(isa: str) -> Path:
    """The compiled library for this source and instruction set, built into the cache
    if it is not there yet (no CPU check: the Docker image builds both where it is
    built); KernelUnavailable without a compiler."""
    flags = (*FLAGS, *ISA_FLAGS[isa])
    src = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    key = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    lib = cache_root() / "kernels" / f"adaserve_cpu-{isa}-{key}.so"
    if lib.exists():
        return lib  # nothing written: a read-only image cache is fine
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise KernelUnavailable("needs a C++ compiler (g++) to build it on first use")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build when several processes start at once
        if not lib.exists():
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")
            proc = subprocess.run(
                [cxx, *flags, "-o", str(tmp), *map(str, SOURCES)], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise KernelUnavailable(f"{cxx} failed: {proc.stderr.strip()[-500:]}")
            tmp.replace(lib)
    return lib


def supported_isas() -> tuple[str, ...]:
    """The builds this CPU runs, widest first (an AVX-512 CPU also runs the AVX2 one);
    KernelUnavailable where none does."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise KernelUnavailable(f"needs x86-64 Linux, not {platform.system()} {platform.machine()}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _TORCH_ISA:
        raise KernelUnavailable(f"needs AVX2 + FMA or AVX-512 (this CPU: {capability})")
    if capability != "AVX512":
        return ("avx2",)
    return ("avx512vnni", "avx512", "avx2") if _cpu_has("avx512_vnni") else ("avx512", "avx2")


@cache
def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (torch's capability does not name VNNI)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(
        flag in line.split(":", 1)[1].split()
        for line in text.splitlines()
        if line.startswith("flags")
    )


@cache
def kernel(isa: str | None = None) -> ctypes.CDLL:
    """The kernel library for `isa` (default: the widest this CPU runs), loaded, and
    built once per source and flags; KernelUnavailable where it cannot run."""
    isas = supported_isas()
    if isa is not None and isa not in isas:
        raise KernelUnavailable(f"this CPU does not run the {isa} build (it runs {isas})")
    dll = ctypes.CDLL(str(build(isa or isas[0])))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    dll.adaserve_skinny_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    dll.adaserve_skinny_linear.restype = None
    dll.adaserve_skinny_block.restype = ctypes.c_int
    dll.adaserve_quant_linear.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, i64, ptr, ptr]
    dll.adaserve_quant_linear.argtypes += [ctypes.c_int]
    dll.adaserve_quant_linear.restype = None
    dll.adaserve_quant_group_bytes.argtypes = [ctypes.c_int]
    dll.adaserve_quant_group_bytes.restype = i64
    dll.adaserve_quant_i8_linear.argtypes = dll.adaserve_quant_linear.argtypes
    dll.adaserve_quant_i8_linear.restype = None
    dll.adaserve_quant_i8_group_bytes.argtypes = [ctypes.c_int]
    dll.adaserve_quant_i8_group_bytes.restype = i64
    f32, i32 = ctypes.c_float, ctypes.c_int
    dll.adaserve_tree_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr]
    dll.adaserve_tree_attention.argtypes += [ptr, ptr, ptr, ptr, i64, ptr, i64, f32, ptr, i32]
    dll.adaserve_tree_attention.restype = i32
    dll.adaserve_rms_norm.argtypes = [ptr, i64, i64, ptr, f32, ptr]
    dll.adaserve_rms_norm.restype = None
    dll.adaserve_quant_columns.argtypes = [ptr, i64, i64, i64, i32, i32, ptr, i64, ptr]
    dll.adaserve_quant_columns.restype = i32
    f = dll.adaserve_decoder_layers
    f.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, ptr, i64]
    f.argtypes += [ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, f32, ptr, i64, ptr, i32]
    f.restype = i32
    return dll


_threads = torch.get_num_threads


def pack(weight_t: torch.Tensor, block: int) -> torch.Tensor:
    """[in, out] -> [ceil(out / block), in, block], zero-padded: one contiguous stream
    per block of output columns (any dtype)."""
    k, n = weight_t.shape
    blocks = -(-n // block)
    padded = torch.zeros(k, blocks * block, dtype=weight_t.dtype)
    padded[:, :n] = weight_t
    return padded.view(k, blocks, block).permute(1, 0, 2).contiguous()


def quantize_columns(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output feature: (q int8 [in, out], scale float32 [out]) with
    weight_t ~= q * scale."""
    w = weight_t.detach().float()
    scale = (w.abs().amax(dim=0) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


class _KernelLinear(nn.Module):
    """The forward of the packed kernel's layers: both entry points take (x, rows, in,
    weights, extra, out, bias, y, threads), `extra` being an int8 layer's scales or a
    GGUF layer's block type. Subclasses bind the pointers once: a forward makes ~120
    of these calls."""

    in_features: int
    out_features: int
    _call: Any
    _w: int
    _extra: int | None
    _b: int | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} takes float32 [T, {self.in_features}], got {x.shape}"
            )
        x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            n, k = self.out_features, self.in_features
            self._call(
                x.data_ptr(), rows, k, self._w, self._extra, n, self._b, y.data_ptr(), _threads()
            )
        return y


class PackedLinear(_KernelLinear):
    """y = x W^T (+ b) through the packed kernel; x [T, in] fp32, any T. With int8,
    W is stored int8 per output feature (a drafter's layers: quantize.py). `isa` picks
    a build other than the CPU's widest (tests compare them)."""

    def __init__(
        self,
        weight_t: torch.Tensor,
        bias: torch.Tensor | None,
        int8: bool = False,
        isa: str | None = None,
    ) -> None:
        super().__init__()
        lib = kernel(isa)
        block = lib.adaserve_skinny_block()
        self.in_features, self.out_features = weight_t.shape
        self.int8 = int8
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.scale: torch.Tensor | None = None  # int8: one per output, zero-padded
        if int8:
            q, scale = quantize_columns(weight_t)
            self.packed = pack(q, block)
            self.scale = torch.zeros(self.packed.shape[0] * block)
            self.scale[: self.out_features] = scale
        else:
            self.packed = pack(weight_t.detach().float(), block)
        self._call = lib.adaserve_skinny_linear
        self._w = self.packed.data_ptr()
        self._extra = None if self.scale is None else self.scale.data_ptr()
        self._b = None if self.bias is None else self.bias.data_ptr()


class BlockFormat(NamedTuple):
    """How the kernel packs one GGUF block type (skinny_gemm.cpp's Quant and QuantI8)."""

    name: str
    block_bytes: int  # per 32 weights, as the kernel takes them
    # A second scale vector after the first: Q4_1's and Q4_K's minimum, Q6_K's scale of
    # weights 16-31.
    second_head: bool
    scale_bytes: int = 2  # float16 scales; float32 for the transcoded K-quants
    int8_quants: bool = False  # one int8 per weight, else a nibble
    # The file's bytes per 256-weight super-block, transcoded to 32-weight blocks at
    # load (k_quant_blocks); 0: the file's blocks are the kernel's.
    super_bytes: int = 0


Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14  # ggml_type ids
# GGUF block types the kernel serves as stored. Q4_K: d, dmin, 12 bytes of scales, 128
# of quants; Q6_K: 128 bytes of low quant bits, 64 of high ones, 16 int8 scales, d.
GGML_TYPES = {
    Q4_0: BlockFormat("Q4_0", 18, False),
    Q4_1: BlockFormat("Q4_1", 20, True),
    Q8_0: BlockFormat("Q8_0", 34, False, int8_quants=True),
    Q4_K: BlockFormat("Q4_K", 24, True, scale_bytes=4, super_bytes=144),
    Q6_K: BlockFormat("Q6_K", 40, True, scale_bytes=4, int8_quants=True, super_bytes=210),
}
GROUP = 32  # weights per GGUF block, along the input features
QK_K = 256  # weights per K-quant super-block
# What QuantLinear multiplies the stored blocks with: float32 activations (each weight
# dequantized exactly: the fp32 kernel's bits) or int8 ones per block of 32 features
# (ggml's Q8_1 quantization of each row, integer dot products per block).
ACTIVATIONS = ("float32", "int8")


def k_quant_blocks(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF K-quant super-blocks of an [out, in] matrix, uint8 [out, in / 256 * super-block
    bytes], as the 32-weight blocks the kernel takes, uint8 [out, in / 32 * block bytes]
    (GGML_TYPES). ggml computes each sub-block's scale (and Q4_K's minimum) in float32
    as a float16 times a 6-bit (Q6_K: int8) integer, which is exact, so stored as
    float32 they give the `gguf` package's dequantized values bit for bit:
    - Q4_K: float32 D = d * sc and -(dmin * mn), then 16 bytes of quants in Q4_1's
      order (byte j: weight j low nibble, j + 16 high); a weight is D * q + (-(dmin *
      mn)) in one rounding (the product is exact). 6 bits a weight (the file: 4.5).
    - Q6_K: float32 d * sc of weights 0-15 and of 16-31, then 32 int8 q - 32, Q8_0's
      layout; (q - 32) * d * sc is exact. 10 bits a weight (the file: 6.6)."""
    from gguf.quants import Q4_K as Q4KQuant

    out = raw.shape[0]
    b = raw.numpy().reshape(-1, GGML_TYPES[ggml_type].super_bytes)  # [super-blocks, bytes]
    n = b.shape[0]
    if ggml_type == Q6_K:
        # 128 bytes of low 4 bits (per half of 128 weights, 64 bytes: weights 0-63 in
        # the low nibbles, 64-127 in the high ones), 64 of high 2 bits (per half, 32
        # bytes: weight 32 s + i in bits 2 s of byte i), 16 int8 scales (one per 16
        # weights), float16 d.
        low = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        high = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1
        )
        q = (low & 15).reshape(n, 2, 128) | ((high & 3).reshape(n, 2, 128) << 4)
        quants = (q.reshape(n, 8, 32).astype(np.int16) - 32).astype(np.int8)
        d = b[:, 208:210].copy().view(np.float16).astype(np.float32)  # [n, 1]
        scale = (d * b[:, 192:208].copy().view(np.int8).astype(np.float32)).reshape(n, 8, 2)
        first, second = (np.ascontiguousarray(scale[:, :, i : i + 1]) for i in (0, 1))
        parts = [first.view(np.uint8), second.view(np.uint8), quants.view(np.uint8)]
    else:
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4KQuant.get_scale_min(b[:, 4:16].copy())  # [n, 8] 6-bit each
        scale = d * sc.astype(np.float32)
        minimum = -(dmin * mn.astype(np.float32))
        # 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and 2c + 1
        # in its high ones, weight i of each in byte i.
        qs = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 15).reshape(n, 8, 32)  # [n, sub-block, weight]
        nib = q[:, :, :16] | (q[:, :, 16:] << 4)  # Q4_1's order
        parts = [
            scale.reshape(n, 8, 1).view(np.uint8),
            minimum.reshape(n, 8, 1).view(np.uint8),
            nib.astype(np.uint8),
        ]
    blocks = np.concatenate(parts, axis=2)  # [n, 8, block bytes]
    return torch.from_numpy(np.ascontiguousarray(blocks).reshape(out, -1))


def pack_gguf(raw: torch.Tensor, ggml_type: int, block: int = 32) -> torch.Tensor:
    """GGUF blocks of an [out, in] matrix, raw uint8 [out, in / 32 * block bytes], ->
    uint8 [ceil(out / block), in / 32, group bytes] (skinny_gemm.cpp's layout): per
    block of output columns and group of 32 features, the columns' scales (float16;
    float32 for the transcoded K-quants), then (Q4_1, Q4_K) minimums or (Q6_K) second
    scales, then per feature the columns' quants, a nibble (byte j: column j
    low, j + 16 high) or a byte each. Bytes are moved, never converted, so the values
    are the GGUF's own; zero-padded columns (scale 0) are zeros."""
    fmt = GGML_TYPES[ggml_type]
    parts, qs = _heads(_columns(raw, fmt, block), fmt)
    blocks, groups = qs.shape[:2]
    if fmt.int8_quants:  # int8 per weight: [b, g, feature, col]
        parts.append(qs.transpose(2, 3).reshape(blocks, groups, GROUP * block))
    else:  # ggml: byte j holds weight j (low nibble) and j + 16 (high)
        q = torch.cat([qs & 15, qs >> 4], dim=3).transpose(2, 3)  # [b, g, feature, col]
        half = block // 2
        nib = q[..., :half] | (q[..., half:] << 4)
        parts.append(nib.reshape(blocks, groups, GROUP * half))
    return torch.cat(parts, dim=2).contiguous()


def _columns(raw: torch.Tensor, fmt: BlockFormat, block: int) -> torch.Tensor:
    """Blocks uint8 [out, groups * block bytes] as [column blocks, groups, column, bytes],
    the columns zero-padded to whole blocks of `block`."""
    out = raw.shape[0]
    groups = raw.shape[1] // fmt.block_bytes
    blocks = -(-out // block)
    padded = torch.zeros(blocks * block, groups, fmt.block_bytes, dtype=torch.uint8)
    padded[:out] = raw.reshape(out, groups, fmt.block_bytes)
    return padded.view(blocks, block, groups, fmt.block_bytes).permute(0, 2, 1, 3)


def _heads(cols: torch.Tensor, fmt: BlockFormat) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Of blocks [b, g, col, bytes]: the columns' scales (and second heads), each
    [b, g, col * scale bytes], and the quant bytes [b, g, col, rest]."""
    blocks, groups, block = cols.shape[:3]
    sb = fmt.scale_bytes
    parts = [cols[..., 0:sb].reshape(blocks, groups, sb * block)]
    if fmt.second_head:
        parts.append(cols[..., sb : 2 * sb].reshape(blocks, groups, sb * block))
    return parts, cols[..., (2 if fmt.second_head else 1) * sb :]


def pack_gguf_i8(raw: torch.Tensor, ggml_type: int, block: int = 32) -> torch.Tensor:
    """GGUF blocks as pack_gguf's, but the quants laid out for the int8-activation path
    (skinny_gemm.cpp's QuantI8): per group, the float16 scales (and Q4_1 minimums),
    then 8 quads of 4 features, each column's 4 quants adjacent (one int32 lane):
    Q4_* 64 bytes, byte b = column b // 4's nibble (low) and column 16 + b // 4's
    (high); Q8_0 128 bytes, byte b = column b // 4's int8. Bytes moved, not converted."""
    assert block == 32
    fmt = GGML_TYPES[ggml_type]
    parts, qs = _heads(_columns(raw, fmt, block), fmt)
    blocks, groups = qs.shape[:2]
    if not fmt.int8_quants:  # byte j: weight j (low nibble), j + 16 (high)
        qs = torch.cat([qs & 15, qs >> 4], dim=3)  # [b, g, col, feature]
    quads = qs.reshape(blocks, groups, block, GROUP // 4, 4).transpose(2, 3)  # [b,g,quad,col,4]
    if not fmt.int8_quants:
        half = block // 2
        quads = quads[:, :, :, :half] | (quads[:, :, :, half:] << 4)
    parts.append(quads.reshape(blocks, groups, -1))
    return torch.cat(parts, dim=2).contiguous()


def unpack_gguf_columns(
    packed: torch.Tensor, ggml_type: int, cols: torch.Tensor, block: int = 32, i8: bool = False
) -> torch.Tensor:
    """The dequantized weights of output columns `cols` of pack_gguf's layout (with
    `i8`, pack_gguf_i8's), float32 [len(cols), in]: ggml's own arithmetic (q * d,
    (q - 8) * d, q * d + m in float32), so the GGUF's dequantized values bit for bit
    (an embedding lookup reads the tied head's blocks through this)."""
    fmt = GGML_TYPES[ggml_type]
    n, groups = cols.numel(), packed.shape[1]
    at = torch.arange(n)
    g = packed[cols // block]  # [n, groups, bytes]
    c = cols % block

    sb = fmt.scale_bytes

    def heads(off: int) -> torch.Tensor:  # a scale per (col, group) -> [n, groups, 1]
        h = g[:, :, off : off + sb * block].contiguous()
        h = h.view(torch.float32 if sb == 4 else torch.float16)
        return h.view(n, groups, block)[at, :, c].float().unsqueeze(-1)

    qoff = (2 if fmt.second_head else 1) * sb * block
    half = block // 2
    qs = g[:, :, qoff:].contiguous()
    if fmt.int8_quants:
        qs = qs.view(torch.int8)
        if i8:  # [n, groups, quad, col, 4]
            q = qs.view(n, groups, 8, block, 4)[at, :, :, c].reshape(n, groups, GROUP)
        else:  # [n, groups, feature, col]
            q = qs.view(n, groups, GROUP, block)[at, :, :, c]
    else:  # nibbles: low for columns 0-15, high for 16-31
        if i8:
            b = qs.reshape(n, groups, 8, half, 4)[at, :, :, c % half].reshape(n, groups, GROUP)
        else:
            b = qs.reshape(n, groups, GROUP, half)[at, :, :, c % half]
        q = torch.where((c >= half).view(n, 1, 1), b >> 4, b & 15).to(torch.int16)
    d = heads(0)
    if ggml_type == Q4_0:
        w = (q - 8).float() * d
    elif ggml_type == Q6_K:  # weights 16-31 of a group have the second scale
        w = q.float() * torch.cat(
            [d.expand(-1, -1, half), heads(sb * block).expand(-1, -1, half)], -1
        )
    elif fmt.second_head:  # a minimum
        w = q.float() * d + heads(sb * block)
    else:
        w = q.float() * d
    return w.reshape(n, groups * GROUP)


class QuantLinear(_KernelLinear):
    """y = x W^T (+ b) with W a GGUF tensor's quantized blocks as stored (Q4_0, Q4_1,
    Q8_0, Q4_K, Q6_K), dequantized in registers by the packed kernel: the same FMA chains
    as PackedLinear over the GGUF's dequantized weights, so the same bits, from a sixth
    (Q4_1) to a quarter (Q8_0) of fp32's bytes (K-quants: 6 and 10 bits a weight,
    k_quant_blocks). `raw`: uint8 [out, in / 32 * block bytes] in GGUF row order
    (K-quants: [out, in / 256 * super-block bytes], in a multiple of 256); `isa` as
    PackedLinear's. `activations` "int8": x's rows
    quantized per 32 features and integer dot products (pack_gguf_i8's layout), the
    result within that rounding, still independent of the rows beside each."""

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        isa: str | None = None,
        activations: str = "float32",
    ) -> None:
        super().__init__()
        lib = kernel(isa)
        block = lib.adaserve_skinny_block()
        fmt = GGML_TYPES.get(ggml_type)
        if fmt is None or in_features % (QK_K if fmt.super_bytes else GROUP):
            raise ValueError(f"ggml type {ggml_type} with {in_features} input features")
        if fmt.super_bytes:
            raw = k_quant_blocks(raw, ggml_type)
        if activations not in ACTIVATIONS:
            raise ValueError(f"unknown activations {activations!r} ({' | '.join(ACTIVATIONS)})")
        self.ggml_type = ggml_type
        self.activations = activations
        self.in_features, self.out_features = in_features, raw.shape[0]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if activations == "int8":
            self.packed = pack_gguf_i8(raw, ggml_type, block)
            assert self.packed.shape[2] == lib.adaserve_quant_i8_group_bytes(ggml_type)
            self._call = lib.adaserve_quant_i8_linear
        else:
            self.packed = pack_gguf(raw, ggml_type, block)
            assert self.packed.shape[2] == lib.adaserve_quant_group_bytes(ggml_type)
            self._call = lib.adaserve_quant_linear
        self._extra = ggml_type
        self._w = self.packed.data_ptr()
        self._b = None if self.bias is None else self.bias.data_ptr()

    @property
    def format(self) -> str:
        return GGML_TYPES[self.ggml_type].name

    def columns(self, cols: torch.Tensor) -> torch.Tensor:
        """Dequantized weights of output features `cols`, float32 [len(cols), in]."""
        return unpack_gguf_columns(self.packed, self.ggml_type, cols, i8=self.activations == "int8")


class QuantEmbedding(nn.Module):
    """The input embedding read from a tied LM head's quantized blocks (the gathered
    rows dequantized, bit for bit the GGUF's values), so one copy stays in memory. The
    library dequantizes the rows: one call, where unpack_gguf_columns' ~20 torch ops
    were ~0.2 ms, 3% of a 135M model's decode step."""

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        self.head = head
        self._columns = kernel().adaserve_quant_columns

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head
        cols = ids.reshape(-1).to(torch.int64).contiguous()
        n = cols.numel()
        out = torch.empty(n, head.in_features, dtype=torch.float32)
        _, groups, group_bytes = head.packed.shape
        i8 = head.activations == "int8"
        args = (head.out_features, groups, group_bytes, head.ggml_type, i8, cols.data_ptr(), n)
        if self._columns(head._w, *args, out.data_ptr()) != 0:
            raise IndexError(f"token id out of range [0, {head.out_features})")
        return out.view(*ids.shape, head.in_features)


class PackedEmbedding(nn.Module):
    """The input embedding read from a tied LM head's packed weights, so a tied model
    keeps one copy of its largest matrix."""

    def __init__(self, head: PackedLinear) -> None:
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        block = self.head.packed.shape[2]
        return self.head.packed[ids // block, :, ids % block]


def packed_kernel_available(mode: str = "auto") -> bool:
    """Whether `mode` asks for the packed kernel and it runs here (logged when not)."""
    if mode not in CPU_KERNELS:
        raise ValueError(f"unknown cpu_kernel {mode!r} ({' | '.join(CPU_KERNELS)})")
    if mode == "mkl":
        return False
    try:
        kernel()
    except (KernelUnavailable, OSError) as exc:
        log.info("CPU linear layers stay on MKL / fbgemm: the packed kernel %s", exc)
        return False
    return True


def pack_linears(model: LlamaModel, mode: str = "auto") -> int:
    """Swap every fp32 linear layer of a one-rank CPU model (the LM head included; a
    tied embedding then reads the head's packed weights) for a PackedLinear, in place.
    Returns how many; 0, leaving MKL, with mode "mkl" or where the kernel cannot run."""
    if not packed_kernel_available(mode):
        return 0
    swapped = 0
    for parent, name, child in linear_layers(model):
        weight = child.weight_t
        if child.tp.size > 1 or weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        packed = PackedLinear(weight, getattr(child, "bias", None))
        if isinstance(model.embed, VocabParallelEmbedding) and weight is model.embed.weight_t:
            model.embed = PackedEmbedding(packed)
        setattr(parent, name, packed)
        swapped += 1
    if swapped:  # an int8 drafter has none left: quantize_int8 said what runs its layers
        log.info(
            "%d fp32 linear layers on the packed CPU kernel (%s)", swapped, supported_isas()[0]
        )
    return swapped
