"""Ship a GGUF Llama target to an offline GPU machine in uploads under 64 MiB each.

The device tool carries at most 64 MiB per call, the repo itself included (~26 MB), and
SmolLM2's Q4_1 GGUF is 98 MB, so the raw quantized blocks (exact, no requantisation)
are split at layer boundaries; part 1 also holds the embedding and the final norm:

    python benchmarks/gpu/distill_pack.py pack GGUF HF_DIR .gpu/target1 .gpu/target2 .gpu/target3 --split-layers 0,15
    python benchmarks/gpu/distill_pack.py unpack OUT1 OUT2 OUT3 DEST   # on the GPU machine

`unpack` needs only numpy, torch and safetensors (no gguf, no transformers) and writes
an HF directory (config.json, tokenizer files, fp32 model.safetensors) identical to
transformers' own GGUF conversion. HF_DIR supplies config.json and tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

SMALL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)
HF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def pack(gguf_path: Path, hf_dir: Path, outs: list[Path], split_layers: list[int]) -> None:
    """Layer i goes to part k where split_layers[k-1] <= i < split_layers[k]."""
    import gguf

    if len(outs) != len(split_layers) + 1 or split_layers != sorted(split_layers):
        raise ValueError(
            f"{len(outs)} parts need {len(outs) - 1} increasing split layers, got {split_layers}"
        )
    reader = gguf.GGUFReader(str(gguf_path))
    parts: list[dict[str, np.ndarray]] = [{} for _ in outs]
    meta: list[dict[str, dict]] = [{} for _ in outs]
    for t in reader.tensors:
        # the first parts alone unpack to a truncated model (smoke runs)
        part = (
            int(np.searchsorted(split_layers, int(t.name.split(".")[1]), side="right"))
            if t.name.startswith("blk.")
            else 0
        )
        parts[part][t.name] = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        shape = [int(x) for x in reversed(t.shape)]  # gguf lists the fastest axis first
        meta[part][t.name] = {"type": t.tensor_type.name, "shape": shape}
    for part, out in enumerate(outs):
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            parts[part], str(out / "raw.safetensors"), metadata={"tensors": json.dumps(meta[part])}
        )
        shutil.copy(hf_dir / "config.json", out / "config.json")
    for name in SMALL_FILES:
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, outs[0] / name)  # the layer parts are the big ones


def _dequantize(raw: np.ndarray, kind: str, shape: list[int]) -> np.ndarray:
    n = int(np.prod(shape))
    if kind == "F32":
        return raw.view(np.float32).reshape(shape)
    if kind == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if kind == "Q8_0":  # blocks of 32: fp16 scale, 32 x int8
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    if kind == "Q4_1":  # blocks of 32: fp16 scale, fp16 min, 16 bytes of nibbles (low half first)
        blocks = raw.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(shape)
    raise ValueError(f"unsupported GGUF tensor type {kind} ({n} values)")


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves q/k rows for its RoPE; undo it as transformers does
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _meta(d: Path) -> dict[str, dict]:
    from safetensors import safe_open

    with safe_open(str(d / "raw.safetensors"), "np") as f:
        return json.loads(f.metadata()["tensors"])


def unpack(dirs: list[Path], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for d in dirs:
        for name in SMALL_FILES:
            if (d / name).is_file():
                shutil.copy(d / name, dest / name)
    cfg = json.loads((dest / "config.json").read_text())
    layers = {int(n.split(".")[1]) for d in dirs for n in _meta(d) if n.startswith("blk.")}
    if layers != set(
        range(cfg["num_hidden_layers"])
    ):  # part 1 alone: a truncated target (smoke tests)
        cfg["num_hidden_layers"] = len(layers)
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    state: dict[str, torch.Tensor] = {}
    for d in dirs:
        meta = _meta(d)
        raw = load_file(str(d / "raw.safetensors"))
        for name, info in meta.items():
            w = _dequantize(raw[name], info["type"], info["shape"])
            if name.startswith("blk."):
                _, layer, kind, _ = name.split(".")
                if kind == "attn_q":
                    w = _reverse_permute(w, cfg["num_attention_heads"])
                elif kind == "attn_k":
                    w = _reverse_permute(w, cfg["num_key_value_heads"])
                key = f"model.layers.{layer}.{HF_NAMES[kind]}.weight"
            else:
                key = {
                    "token_embd.weight": "model.embed_tokens.weight",
                    "output_norm.weight": "model.norm.weight",
                }[name]
            state[key] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    from safetensors.torch import save_file as save_torch

    save_torch(state, str(dest / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("gguf", type=Path)
    p.add_argument("hf_dir", type=Path)
    p.add_argument("outs", type=Path, nargs="+")
    p.add_argument(
        "--split-layers", default="0,15", help="comma list: the first layer of parts 2, 3, ..."
    )
    u = sub.add_parser("unpack")
    u.add_argument("dirs", type=Path, nargs="+")
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.gguf, args.hf_dir, args.outs, [int(x) for x in args.split_layers.split(",")])
    else:
        *srcs, dest = args.dirs
        unpack(srcs, dest)


if __name__ == "__main__":
    main()
