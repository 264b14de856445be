"""Write a trained EAGLE head as a drafter directory (format:
docs/EAGLE_FORMAT.md) and read one back for measuring."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from adaserve.distill.eagle_head import EagleHead, head_state
from adaserve.distill.export import VOCAB_FILE, drafter_config, write_drafter_dir
from adaserve.distill.llama import LlamaShape
from adaserve.distill.weights import read_config

KIND = "eagle"


def contract_state(head: EagleHead) -> dict[str, torch.Tensor]:
    """Head weights under the contract's names: decoder layers and norm as a Hugging
    Face Llama ("model." prefix), fc and fuse under "eagle."."""
    out = {}
    for k, v in head_state(head).items():
        if k.startswith(("fc.", "fuse.")):
            out[f"eagle.{k}"] = v
        else:
            out[f"model.{k}"] = v
    return out


def eagle_config(
    target_cfg: dict,
    head: EagleHead,
    draft_vocab: int,
    target_spec: str,
    weight_format: str,
) -> dict:
    cfg = drafter_config(target_cfg, len(head.layers), draft_vocab, target_spec, weight_format)
    cfg.update(
        {
            "adaserve_drafter_kind": KIND,
            "adaserve_eagle_feature_layers": list(head.feature_layers),
            "adaserve_eagle_target_layers": int(target_cfg["num_hidden_layers"]),
        }
    )
    return cfg


def export_eagle(
    head: EagleHead,
    d2t: torch.Tensor,
    target_dir: Path,
    target_spec: str,
    out: Path,
    weight_format: str = "int8_rowwise",
) -> None:
    cfg = eagle_config(read_config(target_dir), head, len(d2t), target_spec, weight_format)
    write_drafter_dir(out, contract_state(head), d2t, cfg, target_dir)


def is_eagle_dir(path: Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.is_file() and json.loads(cfg.read_text()).get("adaserve_drafter_kind") == KIND


def load_eagle(drafter_dir: Path, target_dir: Path) -> tuple[EagleHead, torch.Tensor, torch.Tensor]:
    """(head, lm_head [V_draft, hidden], d2t [V_draft]) from an EAGLE drafter directory,
    with the target's embedding (target_dir: a Hugging Face directory)."""
    from adaserve.model.draft_assets import dequantize, target_embedding

    cfg = read_config(drafter_dir)
    tcfg = read_config(target_dir)
    if int(cfg["adaserve_eagle_target_layers"]) != int(tcfg["num_hidden_layers"]):
        raise ValueError(
            f"{drafter_dir}: trained for a {cfg['adaserve_eagle_target_layers']}-layer target, "
            f"{target_dir} has {tcfg['num_hidden_layers']}"
        )
    raw = dequantize(load_file(str(Path(drafter_dir) / "model.safetensors")))
    d2t = load_file(str(Path(drafter_dir) / cfg.get("adaserve_draft_vocab", VOCAB_FILE)))["d2t"]
    embed = torch.nn.Embedding.from_pretrained(target_embedding(target_dir), freeze=True)
    shape = LlamaShape.from_hf_config(cfg)
    head = EagleHead(
        shape, int(cfg["num_hidden_layers"]), cfg["adaserve_eagle_feature_layers"], embed
    )
    state = {}
    for k, v in raw.items():
        name = k.removeprefix("eagle.") if k.startswith("eagle.") else k.removeprefix("model.")
        state[name] = v.float()
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"{drafter_dir}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    lm_head = embed.weight[d2t]
    return head.eval().requires_grad_(False), lm_head, d2t
