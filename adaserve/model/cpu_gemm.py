"""fp32 linear layers on x86-64 CPUs through our own few-row GEMM (csrc/skinny_gemm.cpp).

On the CPU a decode step or a tree verification multiplies 1-16 token rows by every
weight of the model, so its cost is reading the weights. MKL's sgemm reads them at
full speed for one row but pays ~1.5x for the 4-8 rows of a verified tree on an Intel
AVX-512 host, and 2-3x on an AMD AVX2 one (where its one-row path is also half our
speed), which eats what speculation gains at one request. The packed kernel streams
each weight once for a few rows at a time: 5 rows cost about what 1 does, and a
256-row prefill chunk within ~10% of MKL (`benchmarks/bench_verify.py --cpu-kernel
auto mkl`).

One source builds for AVX-512 or for AVX2 + FMA, whichever the CPU has
(`supported_isas()`).
Each output is the same sequence of FMA chains (128 input features each, summed in
order) for any number of rows and on either build, so a token's logits do not depend
on the tree verified beside it. The result differs from MKL's in the last bits
(another summation order), as any two BLAS do.

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

import torch
from torch import nn

from adaserve.model.embedded import cache_root
from adaserve.model.layers import VocabParallelEmbedding, linear_layers
from adaserve.model.llama import LlamaModel

log = logging.getLogger("adaserve.model")

CPU_KERNELS = ("auto", "mkl")
CSRC = Path(__file__).parent / "csrc"
# One library: the GEMM, and the per-layer ops beside it (cpu_ops.py).
SOURCES = (CSRC / "skinny_gemm.cpp", CSRC / "cpu_ops.cpp")
HEADERS = (CSRC / "simd.h",)
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# torch's name for the CPU's vector capability -> our build of the kernel for it.
ISA_FLAGS = {"avx512": ("-mavx512f", "-mfma"), "avx2": ("-mavx2", "-mfma")}
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
    return ("avx512", "avx2") if capability == "AVX512" else ("avx2",)


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
    f32, i32 = ctypes.c_float, ctypes.c_int
    dll.adaserve_tree_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr]
    dll.adaserve_tree_attention.argtypes += [ptr, ptr, ptr, ptr, i64, ptr, i64, f32, ptr, i32]
    dll.adaserve_tree_attention.restype = i32
    dll.adaserve_rms_norm.argtypes = [ptr, i64, i64, ptr, f32, ptr]
    dll.adaserve_rms_norm.restype = None
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


class PackedLinear(nn.Module):
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
        # A forward makes ~120 of these calls: bind what does not change once.
        self._call = lib.adaserve_skinny_linear
        self._w = self.packed.data_ptr()
        self._s = None if self.scale is None else self.scale.data_ptr()
        self._b = None if self.bias is None else self.bias.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"PackedLinear takes float32 [T, {self.in_features}], got {x.shape}")
        x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            n, k = self.out_features, self.in_features
            self._call(
                x.data_ptr(), rows, k, self._w, self._s, n, self._b, y.data_ptr(), _threads()
            )
        return y


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
