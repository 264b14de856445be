"""The EAGLE head on the paged runtime (the math: docs/EAGLE_FORMAT.md,
summed up in docs/ARCHITECTURE.md "The EAGLE path").

    g_t      = fuse(features_t)                  # F*H -> H, or the features when F == 1
    x_t      = fc(cat(embed(tok_t), g_{t-1}))    # 2H -> H
    h_t      = DecoderLayers(x_t)                # the head's own paged KV
    logits_t = lm_head(norm(h_t))                # reduced draft vocabulary (d2t)

The head is a `LlamaModel` with the head's layers (built and loaded as a distilled
drafter is: the target's embedding, a tied reduced LM head, packed CPU kernels) plus
`fc` and `fuse`. `EagleRunner` is a `ModelRunner` over it whose forward takes the
g_{t-1} row of every new node beside its token and returns the head's pre-norm output h
with the logits: a drafted node's child reads its parent's h as its g.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from adaserve.model.runner import ModelRunner, SeqInput

EAGLE_KIND = "eagle"


@dataclass(frozen=True)
class EagleSpec:
    """What the verifier must know about a head: which target layers it reads."""

    feature_layers: tuple[int, ...]
    target_layers: int
    hidden_size: int

    @property
    def feature_dim(self) -> int:
        return len(self.feature_layers) * self.hidden_size


def is_eagle_dir(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    return json.loads(cfg.read_text()).get("adaserve_drafter_kind") == EAGLE_KIND


def eagle_spec(path: str | Path) -> EagleSpec:
    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("adaserve_drafter_kind") != EAGLE_KIND:
        raise ValueError(f"{path}: not an EAGLE drafter (adaserve_drafter_kind)")
    layers = tuple(int(i) for i in raw["adaserve_eagle_feature_layers"])
    total = int(raw["adaserve_eagle_target_layers"])
    if not layers or any(not 0 <= i < total for i in layers):
        raise ValueError(f"{path}: adaserve_eagle_feature_layers {layers} not in [0, {total})")
    return EagleSpec(layers, total, int(raw["hidden_size"]))


class EagleRunner(ModelRunner):
    """A ModelRunner whose model is the head's decoder; `forward_head` is its forward."""

    def __init__(
        self,
        base: ModelRunner,
        spec: EagleSpec,
        fc_weight: torch.Tensor,
        fc_bias: torch.Tensor | None,
        fuse_weight: torch.Tensor | None,
    ) -> None:
        super().__init__(
            base.model,
            base.config,
            base.cache,
            base.backend,
            base.device,
            base.dtype,
            base.max_model_len,
        )
        self.draft_to_target = base.draft_to_target
        self.spec = spec
        h = spec.hidden_size
        if tuple(fc_weight.shape) != (h, 2 * h):
            raise ValueError(
                f"eagle.fc.weight must be [{h}, {2 * h}], got {tuple(fc_weight.shape)}"
            )
        want_fuse = (h, spec.feature_dim) if len(spec.feature_layers) > 1 else None
        got_fuse = None if fuse_weight is None else tuple(fuse_weight.shape)
        if got_fuse != want_fuse:
            raise ValueError(f"eagle.fuse.weight must be {want_fuse}, got {got_fuse}")
        dev, dt = base.device, base.dtype
        self.fc_weight = fc_weight.to(device=dev, dtype=dt)
        self.fc_bias = None if fc_bias is None else fc_bias.to(device=dev, dtype=dt)
        self.fuse_weight = None if fuse_weight is None else fuse_weight.to(device=dev, dtype=dt)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise TypeError("EagleRunner: call forward_head (every node needs its g row)")

    @torch.inference_mode()
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g = fuse(features): [T, F*H] target features -> [T, H] in the head's dtype."""
        x = features.to(device=self.device, dtype=self.dtype)
        return x if self.fuse_weight is None else F.linear(x, self.fuse_weight)

    @torch.inference_mode()
    def forward_head(
        self,
        inputs: list[SeqInput],
        g: torch.Tensor,
        logits_indices: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`g`: [sum k, H], the g_{t-1} of every new node (packed in input order).
        Returns (logits float32 [rows, V_draft], h [sum k, H] pre-norm, model dtype).
        KVCacheFull / ValueError leave nothing changed, as ModelRunner.forward."""
        total = sum(len(x.tokens) for x in inputs)
        if tuple(g.shape) != (total, self.spec.hidden_size):
            raise ValueError(f"forward_head: g must be [{total}, {self.spec.hidden_size}]")
        fb = self.prepare(inputs, logits_indices)
        meta = self.backend.plan(fb.attention)
        dev, model = self.device, self.model
        ids = torch.from_numpy(fb.ids).to(dev)
        x = torch.cat([model.embed(ids), g.to(device=dev, dtype=self.dtype)], dim=-1)
        x = F.linear(x, self.fc_weight, self.fc_bias)
        rope = model.rotary.tables(torch.from_numpy(fb.positions).to(dev))
        for layer in model.layers:
            x = layer(x, model.rotary, rope, self.backend, self.cache.storage, meta)
        rows = x
        if fb.logits_rows is not None:
            rows = x.index_select(0, torch.from_numpy(fb.logits_rows).to(dev))
        return model.lm_head(model.norm(rows)).float(), x


def load_eagle_runner(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    **runner_kwargs,
) -> EagleRunner:
    """The head's runner from a drafter directory in the contract's format:
    the decoder as a distilled drafter (build.build_runner: the target's embedding,
    the tied reduced head, int8 dequantized), then fc and fuse from the same file."""
    from adaserve.model import draft_assets
    from adaserve.model.build import build_runner
    from adaserve.model.layers import TPGroup
    from adaserve.model.weights import load_state

    path = Path(path)
    spec = eagle_spec(path)
    base = build_runner(path, device, dtype, TPGroup(), **runner_kwargs)
    raw = json.loads((path / "config.json").read_text())
    state = load_state(path)
    if raw.get("adaserve_weight_format", "float") == "int8_rowwise":
        state = draft_assets.dequantize(state)
    if "eagle.fc.weight" not in state:
        raise ValueError(f"{path}: no eagle.fc.weight")
    fc_b = state.get("eagle.fc.bias")
    fuse = state.get("eagle.fuse.weight")
    return EagleRunner(
        base,
        spec,
        state["eagle.fc.weight"].float(),
        None if fc_b is None else fc_b.float(),
        None if fuse is None else fuse.float(),
    )
