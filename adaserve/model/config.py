"""ModelConfig: the Llama-family hyperparameters, read from a Hugging Face config.json.

Only what the decoder needs, validated once. Accepts both the transformers 4.x
spelling (`rope_theta`, `rope_scaling`) and the 5.x one (`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class UnsupportedModelError(ValueError):
    """The model directory holds something this runtime cannot run; the message names
    the path and the architecture."""


# HF architecture name -> whether q/k/v carry a bias by construction.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v only
    o_bias: bool  # Llama attention_bias=True: bias on o_proj too
    mlp_bias: bool
    rope_scaling: dict[str, Any] | None = None  # rope_type "linear" | "llama3", or None
    sliding_window: int | None = None  # None: full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # config.json and generation_config.json, merged
    source: str = ""  # the directory it came from, for error messages
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise UnsupportedModelError(f"{path}: no config.json (not a Hugging Face model dir)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise UnsupportedModelError(f"{cfg_file}: invalid JSON ({exc})") from exc
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return ModelConfig.from_dict(raw, generation=gen, source=str(path))

    @staticmethod
    def from_dict(
        raw: dict[str, Any], *, generation: dict[str, Any] | None = None, source: str = "<dict>"
    ) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(raw.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {arch!r} (model_type {raw.get('model_type')!r}) is not "
                f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: {arch} with hidden_act={act!r} (need silu)")
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"{source}: {num_heads} heads not divisible by {num_kv_heads} KV heads"
            )
        rope_theta, rope_scaling = _rope(raw, source, arch)
        attention_bias = bool(raw.get("attention_bias", False))
        qkv_bias = SUPPORTED_ARCHITECTURES[arch] or attention_bias
        sliding = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            sliding = None  # Qwen2 configs carry a window they do not use
        eos = _ids(raw.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            source=source,
            extra={"model_type": raw.get("model_type")},
        )

    def check_context(self, max_model_len: int) -> None:
        """Sliding-window attention is not implemented: accept a windowed model only
        when no sequence can outgrow its window (then the window never masks)."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise UnsupportedModelError(
                f"{self.source}: {self.architecture} uses sliding-window attention "
                f"(window {self.sliding_window}) which this runtime does not implement; "
                f"set max_model_len <= {self.sliding_window}"
            )


def _arch_from_model_type(model_type: str | None) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }.get(model_type or "", f"<model_type {model_type}>")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(raw: dict[str, Any], source: str, arch: str) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: {arch} with rope_type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    out = {k: v for k, v in merged.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = rope_type
    return theta, out
