"""EAGLE head directories for tests, in the contract's format
(docs/EAGLE_FORMAT.md), with random weights: losslessness never
depends on the head's quality, and the math is checked against `dense_reference`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from adaserve.distill.export import quantize_int8_rowwise


def make_eagle_dir(
    path: Path,
    target_dir: Path,
    *,
    feature_layers: tuple[int, ...] = (1, 15, 29),
    head_layers: int = 1,
    draft_vocab: int = 4096,
    fc_bias: bool = True,
    int8: bool = False,
    seed: int = 0,
) -> Path:
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    h, inter = int(tcfg["hidden_size"]), int(tcfg["intermediate_size"])
    heads, kv, d = (
        int(tcfg["num_attention_heads"]),
        int(tcfg["num_key_value_heads"]),
        int(tcfg.get("head_dim") or h // int(tcfg["num_attention_heads"])),
    )
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    state: dict[str, torch.Tensor] = {}
    for k in range(head_layers):
        p = f"model.layers.{k}."
        state[p + "input_layernorm.weight"] = 1.0 + w(h, std=0.1)
        state[p + "post_attention_layernorm.weight"] = 1.0 + w(h, std=0.1)
        state[p + "self_attn.q_proj.weight"] = w(heads * d, h)
        state[p + "self_attn.k_proj.weight"] = w(kv * d, h)
        state[p + "self_attn.v_proj.weight"] = w(kv * d, h)
        state[p + "self_attn.o_proj.weight"] = w(h, heads * d)
        state[p + "mlp.gate_proj.weight"] = w(inter, h)
        state[p + "mlp.up_proj.weight"] = w(inter, h)
        state[p + "mlp.down_proj.weight"] = w(h, inter)
    state["model.norm.weight"] = 1.0 + w(h, std=0.1)
    state["eagle.fc.weight"] = w(h, 2 * h)
    if fc_bias:
        state["eagle.fc.bias"] = w(h)
    f = len(feature_layers)
    if f > 1:
        state["eagle.fuse.weight"] = w(h, f * h, std=0.02)
    if int8:
        state = quantize_int8_rowwise(state)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    vocab = int(tcfg["vocab_size"])
    d2t = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values.long()
    save_file({"d2t": d2t}, str(path / "draft_vocab.safetensors"))
    cfg = {
        k: tcfg[k]
        for k in (
            "architectures",
            "model_type",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "vocab_size",
            "hidden_act",
        )
        if k in tcfg
    }
    for k in ("rope_parameters", "rope_theta", "rope_scaling"):
        if k in tcfg:
            cfg[k] = tcfg[k]
    cfg.update(
        num_hidden_layers=head_layers,
        tie_word_embeddings=False,
        adaserve_format_version=1,
        adaserve_drafter_kind="eagle",
        adaserve_eagle_feature_layers=list(feature_layers),
        adaserve_eagle_target_layers=int(tcfg["num_hidden_layers"]),
        adaserve_embeddings_from="target",
        adaserve_target=str(target_dir),
        adaserve_draft_vocab="draft_vocab.safetensors",
        adaserve_draft_vocab_size=draft_vocab,
        adaserve_weight_format="int8_rowwise" if int8 else "float",
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
