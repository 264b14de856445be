"""Every decoder layer of a one-rank fp32 CPU model in one library call
(csrc/cpu_layers.cpp), so a decode step pays Python once per forward, not per op.

With the linear layers, attention and norms already in adaserve's CPU library, a
135M model's decode step on 2 cores still spent ~2 ms of ~7.5 in what lies between
them: ~13 module calls and torch ops per layer (RoPE, the residual adds, SiLU and the
multiply, views and splits), 3-10 us each whatever their size. `CpuLayers` hands the
whole stack to one call over the same kernels, the layers' weights bound once.

A forward goes through it whenever the model was built for it (build.py: every
linear layer on the packed kernel, CpuRMSNorms, the CPU tree-attention backend), for
every kind of forward alike (prompt chunks, tree verification, decode steps, EAGLE's
feature taps), so a position's bits never depend on which kind computed it. They are
not the bits of the module-by-module path (RoPE and SiLU are written out here, with
their own rounding), which stays for every other model and device.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from adaserve.model.cpu_gemm import PackedLinear, QuantLinear, _threads, kernel
from adaserve.model.cpu_ops import LANES, CpuRMSNorm, CpuTreeMetadata
from adaserve.model.kv_cache import KVStorage

if TYPE_CHECKING:
    from adaserve.model.llama import LlamaModel

log = logging.getLogger(__name__)

PACKED, QUANT, QUANT_I8 = 0, 1, 2  # csrc/cpu_layers.cpp Kind


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("weights", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("format", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


def _linear(m: torch.nn.Module) -> _Linear | None:
    """The library's view of a kernel-backed linear layer; None for any other."""
    b = getattr(m, "bias", None)
    bias = None if b is None else b.data_ptr()
    if isinstance(m, PackedLinear):
        scale = None if m.scale is None else m.scale.data_ptr()
        return _Linear(PACKED, m._w, scale, 0, bias, m.in_features, m.out_features)
    if isinstance(m, QuantLinear):
        kind = QUANT_I8 if m.activations == "int8" else QUANT
        return _Linear(kind, m._w, None, m.ggml_type, bias, m.in_features, m.out_features)
    return None


class CpuLayers:
    """The decoder layers of `model`, bound to the library's `isa` build."""

    def __init__(self, model: LlamaModel, layers: ctypes.Array, isa: str | None) -> None:
        cfg = model.cfg
        self.model = model  # keeps the weights the structs point into alive
        self.layers = layers
        self.num_layers = len(layers)
        self.hidden, self.heads, self.kv_heads = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.intermediate = cfg.head_dim, cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        self._call = kernel(isa).adaserve_decoder_layers
        self._no_features = np.full(self.num_layers, -1, dtype=np.int64)

    @staticmethod
    def takes(meta: object) -> bool:
        """Whether a forward planned as `meta` can go through here (the CPU tree
        attention's plan; any other backend's forward goes module by module)."""
        return isinstance(meta, CpuTreeMetadata)

    def run(
        self,
        x: torch.Tensor,
        cis: torch.Tensor,
        kv: KVStorage,
        meta: CpuTreeMetadata,
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] through every layer (a new tensor; x is not changed); cis
        [T, head_dim / 2] complex: each token's rotation. Returns it and, with
        `feature_layers`, the residual stream after each of them, concatenated in that
        order ([T, len * hidden]; None without)."""
        x = x.to(torch.float32, copy=True).contiguous()
        t = x.shape[0]
        rot = torch.view_as_real(cis.reshape(t, -1)).contiguous()
        feats, cols = None, self._no_features
        if feature_layers:
            cols = self._no_features.copy()
            for k, i in enumerate(feature_layers):
                if not 0 <= int(i) < self.num_layers:
                    raise ValueError(f"feature layers {list(feature_layers)} not all in this model")
                cols[int(i)] = k * self.hidden
            feats = torch.empty(t, len(feature_layers) * self.hidden, dtype=torch.float32)
        rc = self._call(
            self.layers,
            self.num_layers,
            x.data_ptr(),
            t,
            self.hidden,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
            self.eps,
            rot.data_ptr(),
            kv.kv.data_ptr(),
            kv.kv.stride(0),
            *meta.pointers(),
            self.scale,
            None if feats is None else feats.data_ptr(),
            0 if feats is None else feats.stride(0),
            cols.ctypes.data,
            _threads(),
        )
        if rc != 0:  # fuse() checked the shapes; a refusal here is a bug
            raise RuntimeError(f"adaserve_decoder_layers refused its arguments (rc {rc})")
        return x, feats


def fuse(model: LlamaModel, isa: str | None = None) -> CpuLayers | None:
    """The model's layers as one call, or None where any of them cannot go (a layer not
    on the packed kernel, a norm not a CpuRMSNorm, shapes the library does not take)."""
    from adaserve.model.llama import DecoderLayer

    cfg = model.cfg
    why = None
    if model.tp.size != 1 or not model.rotary.complex:
        why = "needs one rank and float32"
    elif cfg.hidden_size % LANES or cfg.head_dim % LANES or cfg.intermediate_size % LANES:
        why = f"hidden, head and MLP sizes must be multiples of {LANES}"
    structs: list[_Layer] = []
    for layer in model.layers if why is None else ():
        assert isinstance(layer, DecoderLayer)
        norms = (layer.input_norm, layer.post_norm)
        parts = [
            _linear(m)
            for m in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)
        ]
        if not all(isinstance(n, CpuRMSNorm) and n.eps == cfg.rms_norm_eps for n in norms):
            why = "a norm is not on the CPU library"
            break
        qkv, o, gate_up, down = parts
        if qkv is None or o is None or gate_up is None or down is None:
            why = "a linear layer is not on the packed kernel"
            break
        structs.append(
            _Layer(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), qkv, o, gate_up, down)
        )
    if why is not None:
        log.info("decoder layers stay module by module: %s", why)
        return None
    return CpuLayers(model, (_Layer * len(structs))(*structs), isa)
