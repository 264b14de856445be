"""From a model spec (HF directory, .gguf file or `embedded`) to a runner or tokenizer.

Nothing is fetched from a hub: every path is local, and transformers is called with
`local_files_only=True`. Specs resolve in embedded.py; one rank's runner is built in
build.py, a tensor-parallel group in tp.py.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from adaserve.model.attention_setting import resolve_backend
from adaserve.model.build import build_runner, resolve_device, resolve_dtype
from adaserve.model.config import UnsupportedModelError
from adaserve.model.embedded import resolve_model
from adaserve.model.layers import TPGroup
from adaserve.model.runner import ModelRunner
from adaserve.model.stored import resolve_quantization

if TYPE_CHECKING:
    from adaserve.model.tp import TPRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


def load_tokenizer(spec: str | os.PathLike, role: str = "target") -> Any:
    """The model's tokenizer (AutoTokenizer, local files only); `apply_chat_template`
    works as in transformers when the model ships a chat template."""
    from transformers import AutoTokenizer

    path = resolve_model(spec, role)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{path}: cannot load a tokenizer ({exc})") from exc
