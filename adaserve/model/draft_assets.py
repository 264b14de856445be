"""Load-time completion of distilled drafter directories (format written by
`adaserve distill`, see adaserve/distill/export.py).

A distilled drafter stores only what it trained: its decoder layers and final norm.
Its config.json is a plain Llama config plus these keys:

    "adaserve_format_version": 1
    "adaserve_embeddings_from": "target"   # input embedding = the target's
                                            # model.embed_tokens.weight [vocab, hidden]
    "adaserve_target": "embedded"           # where that target is when the loader has none
    "adaserve_draft_vocab": "draft_vocab.safetensors"   # tensor "d2t" int64 [V_draft]
    "adaserve_weight_format": "float" | "int8_rowwise"  # int8: W = q * weight_scale[:, None]

The LM head is tied: its rows are the target's embedding rows d2t, so the drafter's
logits are over V_draft draft ids and draft id i proposes target token d2t[i].
Verification only ever sees target ids, so it stays lossless.

Loader wiring (one call after reading config.json and the safetensors state dict):

    state, d2t = complete_state_dict(path, config, state, target_path)
    # state now has model.embed_tokens.weight [vocab, hidden] and lm_head.weight
    # [V_draft, hidden] (float32); d2t is int64 [V_draft] or None for plain models.
    # Build the runner's head from lm_head.weight (untied), then BeamDrafter(runner,
    # draft_to_target=d2t).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from adaserve.model.embedded import resolve_model

EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"


def is_distilled_drafter(config: dict) -> bool:
    return config.get("adaserve_embeddings_from") == "target" or "adaserve_draft_vocab" in config


def _find_target_dir(config: dict, target: str | Path | None) -> Path:
    spec = target if target is not None else config.get("adaserve_target")
    if spec is None:
        raise ValueError("this drafter borrows the target's embeddings: give the target model path")
    path = Path(spec)
    if path.is_dir() and any(path.glob("*.safetensors")):
        return path
    # "embedded", a GGUF file, ...: the runtime's resolver converts once and caches
    return Path(resolve_model(str(spec)))


def target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's input embedding float32 [vocab, hidden], read without loading the rest."""
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if EMBED_KEY in st.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return st.get_tensor(EMBED_KEY).float()
    raise ValueError(f"{target_dir}: no {EMBED_KEY} in its safetensors files")


def dequantize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8_rowwise -> float32: every `X.weight_scale` [out] rescales int8 `X.weight` rows."""
    out = {}
    for k, v in state.items():
        if k.endswith(".weight_scale"):
            continue
        scale = state.get(k + "_scale")
        out[k] = v.float() * scale.float()[:, None] if scale is not None else v.float()
    return out


def complete_state_dict(
    model_dir: str | Path,
    config: dict,
    state: dict[str, torch.Tensor],
    target: str | Path | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Fill in what a distilled drafter borrows from its target; plain models pass
    through unchanged (with None). Raises ValueError with a clear message on mismatch."""
    if not is_distilled_drafter(config):
        return state, None
    version = config.get("adaserve_format_version", 1)
    if version != 1:
        raise ValueError(
            f"{model_dir}: drafter format version {version} is newer than this adaserve"
        )
    if config.get("adaserve_weight_format", "float") == "int8_rowwise":
        state = dequantize(state)
    state = {k: v.float() for k, v in state.items()}
    if config.get("adaserve_embeddings_from") == "target":
        embed = target_embedding(_find_target_dir(config, target))
        want = (int(config["vocab_size"]), int(config["hidden_size"]))
        if tuple(embed.shape) != want:
            raise ValueError(
                f"{model_dir}: drafter expects a target embedding of shape {want}, "
                f"the target has {tuple(embed.shape)}: wrong target model?"
            )
        state[EMBED_KEY] = embed
    if EMBED_KEY not in state:
        raise ValueError(f"{model_dir}: no {EMBED_KEY} and no adaserve_embeddings_from")
    d2t = None
    vocab_file = config.get("adaserve_draft_vocab")
    if vocab_file:
        d2t = load_file(str(Path(model_dir) / vocab_file))["d2t"].long()
        if d2t.ndim != 1 or int(d2t.min()) < 0 or int(d2t.max()) >= state[EMBED_KEY].shape[0]:
            raise ValueError(f"{model_dir}/{vocab_file}: d2t must be int64 [V_draft] of target ids")
        state[HEAD_KEY] = state[EMBED_KEY][d2t].clone()
    elif HEAD_KEY not in state:
        state[HEAD_KEY] = state[EMBED_KEY]
    return state, d2t
