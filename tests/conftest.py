"""Shared fixtures: tiny random Llama-family checkpoints written as real HF directories
(config.json + safetensors via save_pretrained), and the embedded SmolLM2 directory.

`make_tiny_model(dir, kind, **overrides)` is importable for tests that need a custom
shape; the fixtures cover the common cases and are built once per session.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.2,  # HF's 0.02 gives near-zero logits: too easy to match
    tie_word_embeddings=True,
)


def make_tiny_model(path: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random `kind` (llama | llama3 | qwen2 | mistral) model to `path`."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    args = {**TINY, **overrides}
    if kind == "llama":
        config, cls = LlamaConfig(**args), LlamaForCausalLM
    elif kind == "llama3":
        args.setdefault("rope_theta", 500000.0)
        args.setdefault(
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        config, cls = LlamaConfig(**args), LlamaForCausalLM
    elif kind == "qwen2":
        config, cls = Qwen2Config(**args), Qwen2ForCausalLM
    elif kind == "mistral":
        args.setdefault("sliding_window", None)
        config, cls = MistralConfig(**args), MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize so they matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-untied"), "llama", tie_word_embeddings=False
    )


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama3"), "llama3")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (converted once into the cache on
    first use, ~1 min; later sessions reuse it)."""
    from adaserve.model.embedded import resolve_model

    return resolve_model("embedded")
