"""From a model spec (HF directory, .gguf file or `embedded`) to a runner or tokenizer.

Nothing is fetched from a hub: every path is local, and transformers is called with
`local_files_only=True`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from adaserve.model import draft_assets
from adaserve.model.attention import make_backend, resolve_backend
from adaserve.model.config import ModelConfig, UnsupportedModelError
from adaserve.model.embedded import ModelNotFoundError, converted_dir, embedded_gguf
from adaserve.model.kv_cache import KVStorage, PagedKVCache
from adaserve.model.layers import TPGroup
from adaserve.model.llama import LlamaModel
from adaserve.model.runner import ModelRunner
from adaserve.model.stored import gguf_source, resolve_quantization, serve_stored
from adaserve.model.weights import WeightSource, load_state

if TYPE_CHECKING:
    from adaserve.model.tp import TPRunner

__all__ = [
    "ModelNotFoundError",
    "UnsupportedModelError",
    "build_runner",
    "load_runner",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_model",
]

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
DRAFTER_ASSET = Path(__file__).resolve().parent.parent / "assets" / "drafter-smollm2"
# The EAGLE head trained for the embedded target (`--drafter embedded-eagle`).
EMBEDDED_EAGLE = "embedded-eagle"
EAGLE_ASSET = Path(__file__).resolve().parent.parent / "assets" / "drafter-smollm2-eagle"
DEFAULT_KV_MEMORY_GB = 2.0

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def resolve_model(spec: str | os.PathLike, role: str = "target") -> Path:
    """A local HF directory for `spec`: itself if it is one, a cached conversion of a
    .gguf file, or the embedded model (`role` picks the target or the shipped drafter)."""
    if str(spec) == EMBEDDED_EAGLE:
        if role != "drafter" or not (EAGLE_ASSET / "config.json").is_file():
            raise ModelNotFoundError(
                f"{EMBEDDED_EAGLE}: a drafter name only, and {EAGLE_ASSET} has no trained "
                f"EAGLE head yet (run `adaserve distill --kind eagle` or pass its directory)"
            )
        return EAGLE_ASSET
    if str(spec) == EMBEDDED:
        if role == "drafter":
            if not (DRAFTER_ASSET / "config.json").is_file():
                raise ModelNotFoundError(
                    f"embedded drafter: {DRAFTER_ASSET} has no trained drafter yet "
                    f"(run `adaserve distill` or pass --drafter PATH)"
                )
            return DRAFTER_ASSET
        if role != "target":
            raise ValueError(f"role must be 'target' or 'drafter', got {role!r}")
        return converted_dir(embedded_gguf())
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(spec)!r} does not exist (models are never downloaded: pass a "
            f"local Hugging Face directory, a .gguf file, or 'embedded')"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnsupportedModelError(f"{path}: a model file must be .gguf")
        return converted_dir(path)
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return converted_dir(ggufs[0])
    raise UnsupportedModelError(
        f"{path}: not a model directory (no config.json"
        + (f"; {len(ggufs)} .gguf files, pass one" if ggufs else "")
        + ")"
    )


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


def load_runner(
    spec: str | os.PathLike,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    *,
    role: str = "target",
    tp: int = 1,
    kv_block_size: int = 16,
    kv_blocks: int | None = None,
    kv_memory_gb: float | None = None,
    max_model_len: int | None = None,
    attention_backend: str = "auto",
    threads: int | None = None,
    quantization: str = "none",
    cpu_kernel: str = "auto",
    prefix_caching: bool = True,
    stored_activations: str = "float32",
) -> ModelRunner | TPRunner:
    """Load a runner. `tp > 1` starts tp-1 worker processes (this process is rank 0)
    and returns a TPRunner with the same interface. `quantization`: "none", "int8"
    (weight-only per output feature on the CPU: adaserve/model/quantize.py), "stored"
    (a GGUF model's quantized blocks as stored: adaserve/model/stored.py) or "auto"
    (stored where it runs, else none), its layers multiplying `stored_activations`
    ("int8" or "float32": cpu_gemm.QuantLinear); `cpu_kernel` "auto" runs a one-rank fp32
    CPU model's linear layers on the packed kernel where it builds, and its RMSNorms
    and small-batch attention on the ops built with it, "mkl" on MKL and torch
    (adaserve/model/cpu_gemm.py, cpu_ops.py)."""
    # Before anything loads or converts: a backend that cannot run here fails at once.
    resolve_backend(attention_backend, resolve_device(device))
    path = resolve_model(spec, role)
    dev = resolve_device(device)
    # `stored` that cannot run here fails before any worker starts.
    quantization = resolve_quantization(
        quantization, path, dev, resolve_dtype(dtype, dev), tp, cpu_kernel
    )
    kwargs: dict[str, Any] = dict(
        kv_block_size=kv_block_size,
        kv_blocks=kv_blocks,
        kv_memory_gb=kv_memory_gb,
        max_model_len=max_model_len,
        attention_backend=attention_backend,
        quantization=quantization,
        stored_activations=stored_activations,
        cpu_kernel=cpu_kernel,
        prefix_caching=prefix_caching,
    )
    if threads is not None:
        torch.set_num_threads(threads)
    if tp > 1:
        from adaserve.model.tp import TPRunner

        return TPRunner.launch(path, tp, str(device), str(dtype), kwargs)
    return build_runner(path, dev, resolve_dtype(dtype, dev), TPGroup(), **kwargs)


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
    elif quantization == "int8" and device.type == "cpu":
        from adaserve.model.quantize import quantize_int8

        quantize_int8(model, cpu_kernel)
    elif quantization == "int8":  # one settings file serves a laptop and a GPU box alike
        log.info("%s: int8 quantization is for the CPU; on %s it runs in %s", path, device, dtype)
    heads = cfg.num_heads // tp.size
    backend = None
    if device.type == "cpu" and dtype == torch.float32 and tp.size == 1:
        from adaserve.model import cpu_ops
        from adaserve.model.cpu_gemm import pack_linears, packed_kernel_available

        pack_linears(model, cpu_kernel)
        if packed_kernel_available(cpu_kernel):  # the per-layer ops come with the GEMM
            cpu_ops.swap_norms(model)
            if attention_backend == "auto" and cpu_ops.supports(heads, kv_heads, cfg.head_dim):
                backend = cpu_ops.CpuTreeBackend(heads, kv_heads, cfg.head_dim)
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


def load_tokenizer(spec: str | os.PathLike, role: str = "target") -> Any:
    """The model's tokenizer (AutoTokenizer, local files only); `apply_chat_template`
    works as in transformers when the model ships a chat template."""
    from transformers import AutoTokenizer

    path = resolve_model(spec, role)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{path}: cannot load a tokenizer ({exc})") from exc
