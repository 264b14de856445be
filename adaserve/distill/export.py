"""Write a trained student as a drafter directory (format: adaserve/model/draft_assets.py)
and read one back as a `LlamaModel` for measuring."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adaserve.distill.llama import LlamaModel
from adaserve.distill.weights import read_config

# What a drafter directory takes from its target: the generation config (its EOS ids,
# which ModelConfig merges in). No tokenizer: a drafter shares its target's vocabulary
# (it borrows the target's embedding; d2t maps its ids to the target's), so the tokenizer
# is the target's, stored once, with the target (`load_tokenizer(target)`).
FROM_TARGET = ("generation_config.json",)
VOCAB_FILE = "draft_vocab.safetensors"


def quantize_int8_rowwise(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """2-D weights -> int8 + fp16 per-row scale (`X.weight_scale`); 1-D stay fp16."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        v = v.float()
        if v.ndim == 2:
            scale = (v.abs().amax(1) / 127.0).clamp(min=1e-8)
            out[k] = torch.round(v / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[k + "_scale"] = scale.half().contiguous()
        else:
            out[k] = v.half().contiguous()
    return out


def drafter_config(
    target_cfg: dict, num_layers: int, draft_vocab: int, target_spec: str, weight_format: str
) -> dict:
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "mlp_bias",
    )
    cfg = {k: target_cfg[k] for k in keep if k in target_cfg}
    cfg.update(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": num_layers,
            "tie_word_embeddings": True,
            "torch_dtype": "float16",
            "adaserve_format_version": 1,
            "adaserve_embeddings_from": "target",
            "adaserve_target": target_spec,
            "adaserve_draft_vocab": VOCAB_FILE,
            "adaserve_draft_vocab_size": draft_vocab,
            "adaserve_weight_format": weight_format,
        }
    )
    return cfg


def export_drafter(
    student_state: dict[str, torch.Tensor],  # LlamaModel names without embed_tokens
    d2t: torch.Tensor,
    target_dir: Path,
    target_spec: str,
    out: Path,
    weight_format: str = "float",
) -> None:
    num_layers = 1 + max(int(k.split(".")[1]) for k in student_state if k.startswith("layers."))
    state = {f"model.{k}": v for k, v in student_state.items()}
    cfg = drafter_config(read_config(target_dir), num_layers, len(d2t), target_spec, weight_format)
    write_drafter_dir(out, state, d2t, cfg, target_dir)


def write_drafter_dir(
    out: Path, state: dict[str, torch.Tensor], d2t: torch.Tensor, cfg: dict, target_dir: Path
) -> None:
    """Weights (in cfg's adaserve_weight_format), d2t, config.json and the target's
    generation config: what every distilled drafter directory holds."""
    out.mkdir(parents=True, exist_ok=True)
    weight_format = cfg["adaserve_weight_format"]
    if weight_format == "int8_rowwise":
        state = quantize_int8_rowwise(state)
    elif weight_format == "float":
        state = {k: v.half().contiguous() for k, v in state.items()}
    else:
        raise ValueError(f"unknown weight format {weight_format!r}")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file({"d2t": d2t.long().cpu().contiguous()}, str(out / VOCAB_FILE))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in FROM_TARGET:
        if (Path(target_dir) / name).is_file():
            shutil.copy(Path(target_dir) / name, out / name)


def load_drafter(
    drafter_dir: Path, target: str | Path | None = None
) -> tuple[LlamaModel, torch.Tensor, torch.Tensor]:
    """(student, head [V_draft, hidden], d2t [V_draft]) from a drafter directory."""
    from adaserve.distill.llama import LlamaShape
    from adaserve.model import draft_assets  # the runtime's own hook: measure what ships

    cfg = read_config(drafter_dir)
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(Path(drafter_dir).glob("*.safetensors")):
        if f.name != VOCAB_FILE:
            raw.update(load_file(str(f)))
    state, d2t = draft_assets.complete_state_dict(drafter_dir, cfg, raw, target)
    model = LlamaModel(LlamaShape.from_hf_config(cfg), int(cfg["num_hidden_layers"]))
    head = state.pop(draft_assets.HEAD_KEY)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    if d2t is None:
        d2t = torch.arange(head.shape[0])
    return model.eval().requires_grad_(False), head, d2t
