"""Load a Hugging Face Llama directory (safetensors) into `LlamaModel`s: the frozen
teacher, and a few-layer student initialised from chosen teacher layers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from adaserve.distill.llama import LlamaModel, LlamaShape


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir}: no config.json (expected a Hugging Face model directory)"
        )
    return json.loads(path.read_text())


def load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """All safetensors shards of a model dir, with the `model.` prefix stripped."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    files = [f for f in files if f.name != "draft_vocab.safetensors"]
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return {k.removeprefix("model."): v for k, v in state.items()}


def load_teacher(model_dir: Path, device: torch.device | str = "cpu") -> LlamaModel:
    cfg = read_config(model_dir)
    if cfg.get("model_type") not in ("llama", "mistral", None):
        raise ValueError(
            f"{model_dir}: model_type {cfg.get('model_type')!r} is not a Llama-family model"
        )
    shape = LlamaShape.from_hf_config(cfg)
    model = LlamaModel(shape, int(cfg["num_hidden_layers"]))
    state = {k: v.float() for k, v in load_state(model_dir).items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.requires_grad_(False)
    return model.to(device).eval()


def init_layer_indices(num_draft_layers: int, num_target_layers: int) -> list[int]:
    """Teacher layers to copy: the first (it reads raw embeddings) and the last (its output
    feeds the shared norm and head), the rest spread evenly in between."""
    if num_draft_layers < 1 or num_draft_layers > num_target_layers:
        raise ValueError(f"draft layers must be in 1..{num_target_layers}, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [0]
    step = (num_target_layers - 1) / (num_draft_layers - 1)
    return [round(i * step) for i in range(num_draft_layers)]


def init_student(teacher: LlamaModel, num_layers: int) -> LlamaModel:
    """A student whose embedding is the teacher's (shared, frozen) and whose layers and
    final norm start as copies of teacher layers."""
    student = LlamaModel(teacher.shape, num_layers).to(teacher.embed_tokens.weight.device)
    src = init_layer_indices(num_layers, len(teacher.layers))
    for dst, i in enumerate(src):
        student.layers[dst].load_state_dict(teacher.layers[i].state_dict())
    student.norm.load_state_dict(teacher.norm.state_dict())
    student.embed_tokens = teacher.embed_tokens  # shared and frozen: never trained or saved
    return student


def trainable_state(student: LlamaModel) -> dict[str, torch.Tensor]:
    """What a drafter directory stores: every weight except the borrowed embedding."""
    return {
        k: v.detach().clone()
        for k, v in student.state_dict().items()
        if not k.startswith("embed_tokens.")
    }
