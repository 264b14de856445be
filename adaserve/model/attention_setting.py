"""The `model.attention_backend` setting: which attention backend runs on a device, and
building it. GPU backends are imported only when chosen (their modules need triton or
flashinfer); the reference backend and the batch they all read are in attention.py."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from adaserve.model.attention import AttentionBackend, ReferenceBackend

ATTENTION_BACKENDS = ("auto", "reference", "triton", "flashinfer")  # model.attention_backend


class BackendUnavailable(ValueError):
    """The attention backend asked for cannot run here (startup error, not a bug)."""


def _importable(module: str) -> bool:
    """Whether `module` imports (not only whether it is installed: flashinfer's import
    fails on a machine whose CUDA it was not built for)."""
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or a CUDA/ABI error raised by the package at import
        return False
    return True


def resolve_backend(
    name: str, device: torch.device, importable: Callable[[str], bool] = _importable
) -> str:
    """The backend `model.attention_backend = name` runs on `device`.

    auto: FlashInfer where it imports on CUDA, else Triton on CUDA, else the reference
    (on a CPU the loader swaps in the packed CPU kernel where it is built). An explicit
    GPU backend that cannot run here is a `BackendUnavailable` naming the setting."""
    if name not in ATTENTION_BACKENDS:
        raise BackendUnavailable(
            f"model.attention_backend: unknown attention backend {name!r} "
            f"({' | '.join(ATTENTION_BACKENDS)})"
        )
    cuda = device.type == "cuda"
    if name == "auto":
        if cuda and importable("flashinfer"):
            return "flashinfer"
        return "triton" if cuda and importable("triton") else "reference"
    # Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors: tests.
    interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if name in ("triton", "flashinfer") and not cuda and not interpreted:
        raise BackendUnavailable(
            f"model.attention_backend is {name!r}, which needs a CUDA device, but the "
            f"model runs on {device.type!r}: use 'auto' or 'reference'"
        )
    if name in ("triton", "flashinfer") and not importable(name):
        extra = (
            "it ships with CUDA builds of PyTorch"
            if name == "triton"
            else ("pip install 'adaserve[gpu]'")
        )
        raise BackendUnavailable(
            f"model.attention_backend is {name!r}, but the {name} package does not import "
            f"here ({extra}): use 'auto' to take the best one that does"
        )
    return name


def make_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    *,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> AttentionBackend:
    """The backend `resolve_backend(name, device)` picks; GPU backends are imported only
    when picked (their modules need triton / flashinfer). FlashInfer reads the cache as
    pages, so it must know the cache's `block_size` and `dtype`."""
    chosen = resolve_backend(name, device)
    if chosen == "reference":
        return ReferenceBackend(num_heads, num_kv_heads, head_dim, device)
    if chosen == "triton":
        from adaserve.model.attention_triton import TritonBackend

        return TritonBackend(num_heads, num_kv_heads, head_dim, device)
    from adaserve.model.attention_flashinfer import FlashInferBackend as FlashInfer

    return FlashInfer(num_heads, num_kv_heads, head_dim, device, block_size, dtype)
