"""The target's features for EAGLE training, stored beside the generated sequences.

`gen_<phase>.safetensors` holds a phase's sequences (adaserve/distill/data.py);
`feat_<phase>.safetensors` holds "features" float16 [total tokens, F * hidden], one row
per token of those sequences in the same flat order: the residual stream after each
feature layer at that position (captured while generating, so the target never runs
again). The last token of every sequence has a zero row: it is never fed to the target,
and an EAGLE head at position t only reads the features of t - 1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from adaserve.distill.data import Sequences


def feature_path(gen_path: Path) -> Path:
    return gen_path.with_name(gen_path.name.replace("gen_", "feat_", 1))


def build_features(conts: list, width: int) -> np.ndarray:
    """float16 [tokens, width] for the continuations Sequences.build keeps (those with
    tokens), in its order; `width` = F * hidden."""
    rows = []
    for c in conts:
        if c is None or not c.tokens:
            continue
        if c.features is None:
            raise ValueError("a continuation was generated without features")
        rows.append(c.features.numpy().astype(np.float16))
        rows.append(np.zeros((1, width), np.float16))  # the never-fed last token
    if not rows:
        return np.zeros((0, width), np.float16)
    return np.concatenate(rows)


def save_features(path: Path, feats: np.ndarray, layers: tuple[int, ...]) -> None:
    save_file(
        {"features": torch.from_numpy(np.ascontiguousarray(feats))},
        str(path),
        metadata={"feature_layers": ",".join(str(i) for i in layers)},
    )


def load_features(path: Path) -> np.ndarray:
    return load_file(str(path))["features"].numpy()


def load_phase_features(
    gen_paths: list[Path], parts: list[Sequences], layers: tuple[int, ...]
) -> np.ndarray:
    """Features for Sequences.concat(parts), checked against their token counts and the
    layers they were captured at."""
    from safetensors import safe_open

    out = []
    for gp, seqs in zip(gen_paths, parts, strict=True):
        if not len(seqs):
            continue
        fp = feature_path(gp)
        if not fp.is_file():
            raise ValueError(f"{fp}: missing (generated without feature capture?)")
        with safe_open(str(fp), "pt") as f:
            meta = (f.metadata() or {}).get("feature_layers", "")
        if meta != ",".join(str(i) for i in layers):
            raise ValueError(f"{fp}: features of layers [{meta}], this run asks for {list(layers)}")
        feats = load_features(fp)
        if len(feats) != len(seqs.tokens):
            raise ValueError(f"{fp}: {len(feats)} rows for {len(seqs.tokens)} tokens")
        out.append(feats)
    return np.concatenate(out) if out else np.zeros((0, 0), np.float16)
