"""One rank's ModelRunner from a resolved Hugging Face directory: the model, its
weights (a distilled drafter completed from its target), quantization, the KV cache and
the attention backend. loader.load_runner calls it for one rank; each tensor-parallel
worker (tp.py) calls it for its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from adaserve.model import draft_assets
from adaserve.model.attention_setting import make_backend
from adaserve.model.config import ModelConfig, UnsupportedModelError
from adaserve.model.kv_cache import KVStorage, PagedKVCache
from adaserve.model.layers import TPGroup
from adaserve.model.llama import LlamaModel
from adaserve.model.runner import ModelRunner
from adaserve.model.stored import gguf_source, resolve_quantization, serve_int4, serve_stored
from adaserve.model.weights import WeightSource, load_state

log = logging.getLogger(__name__)

DEFAULT_KV_MEMORY_GB = 2.0


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (bf16 is slower without AVX512-BF16), bfloat16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r} (auto | float32 | bfloat16 | float16)")
    return table[dtype]


def build_runner(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPGroup,
    *,
    kv_block_size: int = 16,
    kv_blocks: int | None = None,
    kv_memory_gb: float | None = None,
    max_model_len: int | None = None,
    attention_backend: str = "auto",
    quantization: str = "none",
    cpu_kernel: str = "auto",
    prefix_caching: bool = True,
    stored_activations: str = "float32",
) -> ModelRunner:
    """Build this rank's runner from a resolved HF directory."""
    cfg = ModelConfig.from_dir(path)
    tp.split(cfg.num_kv_heads, f"{path}: num_key_value_heads")
    src, head_rows, d2t = _weights(path, cfg)
    if d2t is not None:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    kv_heads = cfg.num_kv_heads // tp.size
    if kv_blocks is None:
        per_block = kv_block_size * KVStorage.bytes_per_token(
            cfg.num_layers, kv_heads, cfg.head_dim, dtype
        )
        kv_blocks = max(1, int((kv_memory_gb or DEFAULT_KV_MEMORY_GB) * 2**30 // per_block))
    capacity = kv_blocks * kv_block_size
    max_len = max_model_len or min(cfg.max_position_embeddings, capacity)
    cfg.check_context(max_len)
    model = LlamaModel(cfg, max_len, tp, dtype, device, head_rows=head_rows)
    with src:
        model.load_weights(src)
    model.eval()
    quantization = resolve_quantization(quantization, path, device, dtype, tp.size, cpu_kernel)
    formats: dict[str, int] = {}
    if quantization == "stored":
        source = gguf_source(path)
        assert source is not None  # resolve_quantization checked
        formats = dict(serve_stored(model, source, activations=stored_activations))
    elif quantization == "int4":
        formats = dict(serve_int4(model, activations=stored_activations))
    elif quantization == "int8":  # a CPU's (resolve_quantization: none on a GPU)
        from adaserve.model.quantize import quantize_int8

        quantize_int8(model, cpu_kernel)
    heads = cfg.num_heads // tp.size
    backend = None
    if device.type == "cpu" and dtype == torch.float32 and tp.size == 1:
        from adaserve.model import cpu_layers, cpu_ops
        from adaserve.model.cpu_gemm import pack_linears, packed_kernel_available

        pack_linears(model, cpu_kernel)
        if packed_kernel_available(cpu_kernel):  # the per-layer ops come with the GEMM
            cpu_ops.swap_norms(model)
            if attention_backend == "auto" and cpu_ops.supports(heads, kv_heads, cfg.head_dim):
                backend = cpu_ops.CpuTreeBackend(heads, kv_heads, cfg.head_dim)
                model.cpu_layers = cpu_layers.fuse(model)
    storage = KVStorage(
        cfg.num_layers, kv_blocks, kv_block_size, kv_heads, cfg.head_dim, dtype, device
    )
    cache = PagedKVCache(storage, kv_blocks, kv_block_size, prefix_caching)
    if backend is None:
        backend = make_backend(
            attention_backend,
            heads,
            kv_heads,
            cfg.head_dim,
            device,
            block_size=kv_block_size,
            dtype=dtype,
        )
    log.info(
        "%s: attention backend %s (model.attention_backend: %s, %s %s)",
        path.name,
        backend.name,
        attention_backend,
        device,
        str(dtype).removeprefix("torch."),
    )
    runner = ModelRunner(model, cfg, cache, backend, device, dtype, max_len)
    runner.draft_to_target = None if d2t is None else d2t.to(device)
    runner.quantization = quantization
    runner.weight_formats = formats
    return runner


def _weights(path: Path, cfg: ModelConfig) -> tuple[WeightSource, int | None, torch.Tensor | None]:
    """The checkpoint, completed in memory when it is a distilled drafter (which borrows
    the target's embedding and may carry a reduced draft vocabulary, see
    draft_assets.py). Returns (source, LM head rows or None, draft->target ids or None)."""
    raw = json.loads((path / "config.json").read_text())
    if not draft_assets.is_distilled_drafter(raw):
        return WeightSource(path), None, None
    try:
        state, d2t = draft_assets.complete_state_dict(path, raw, load_state(path))
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from exc
    return WeightSource(path, state), int(state[draft_assets.HEAD_KEY].shape[0]), d2t
