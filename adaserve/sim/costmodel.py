"""Hardware profiles: how long the verifier and the drafter take, as piecewise-linear tables.

A profile is YAML (the shipped ones live in `adaserve/sim/profiles/`; `adaserve profile`
writes the same format for the machine at hand):

    name: llama-3.1-70b-tp4-a100
    verify:          # one target forward over `tokens` tree tokens with `context`
      tokens: [1, 128, 256, 512, 1024]          # cached tokens in the batch's KV
      context: [0, 262144]
      ms: [[27, 55, 85, 125, 205],              # one row per context value
           [41, 69, 99, 139, 219]]
    draft_step: {tokens: [1, 256, 1024], ms: [4.5, 6.5, 14]}   # one drafter forward
    prefill: {tokens: [1, 1024, 8192], ms: [28, 205, 1560]}    # target prefill
    kv_capacity_tokens: 500000

Between points latency is linear; beyond the last point it continues the last segment
(a forward twice as large costs about twice as much; a falling last segment, noise in a
measured table, is held flat), below the first it is clamped.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

PROFILE_DIR = Path(__file__).parent / "profiles"
# The baseline TPOT that SLO classes scale (paper 000): plain decoding at batch 8 with
# 32-token prompts, halfway through 128-token outputs.
BASELINE_BATCH = 8
BASELINE_CONTEXT = BASELINE_BATCH * (32 + 64)  # cached tokens over the whole batch


class Curve(BaseModel):
    """Latency in ms as a piecewise-linear function of a token count."""

    model_config = ConfigDict(extra="forbid")
    tokens: list[float] = Field(min_length=1)
    ms: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Curve:
        if len(self.tokens) != len(self.ms):
            raise ValueError(f"{len(self.tokens)} token points but {len(self.ms)} latencies")
        _check_axis("tokens", self.tokens)
        if any(not (m >= 0 and np.isfinite(m)) for m in self.ms):
            raise ValueError("latencies must be finite and >= 0")
        return self

    def __call__(self, tokens: float) -> float:
        return _interp(float(tokens), self.tokens, self.ms)


class Surface(BaseModel):
    """Latency in ms over (tree tokens, total context): bilinear in both axes."""

    model_config = ConfigDict(extra="forbid")
    tokens: list[float] = Field(min_length=1)
    context: list[float] = Field(default_factory=lambda: [0.0])
    ms: list[list[float]] = Field(min_length=1)  # [len(context)][len(tokens)]

    @model_validator(mode="after")
    def _check(self) -> Surface:
        _check_axis("tokens", self.tokens)
        _check_axis("context", self.context)
        if len(self.ms) != len(self.context) or any(len(r) != len(self.tokens) for r in self.ms):
            raise ValueError(
                f"ms must have one row per context value ({len(self.context)}) and one "
                f"column per token value ({len(self.tokens)})"
            )
        if any(not (m >= 0 and np.isfinite(m)) for row in self.ms for m in row):
            raise ValueError("latencies must be finite and >= 0")
        return self

    def __call__(self, tokens: float, context: float) -> float:
        rows = [_interp(float(tokens), self.tokens, row) for row in self.ms]
        return max(0.0, _interp(float(context), self.context, rows))


def _check_axis(name: str, xs: list[float]) -> None:
    if any(not np.isfinite(x) or x < 0 for x in xs):
        raise ValueError(f"{name} must be finite and >= 0")
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise ValueError(f"{name} must be strictly increasing, got {xs}")


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:  # continue the last segment: cost keeps growing with size
        # (never shrinking: a noisy measured table must not extrapolate below zero)
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


class HardwareProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    target: str = ""
    drafter: str = ""
    verify: Surface
    draft_step: Curve
    prefill: Curve
    # Host-side work per iteration not covered by the tables (scheduling, sampling).
    iteration_overhead_ms: float = Field(default=0.0, ge=0.0)
    kv_capacity_tokens: PositiveInt = 500_000
    max_model_len: PositiveInt = 32768
    vocab_size: PositiveInt = 128_256
    budget: PositiveInt = 256  # verifier tokens per iteration (the knee), engine default
    # Per-token latency of plain decoding at near-zero load; None -> derived (below).
    baseline_tpot_ms: PositiveFloat | None = None

    def verify_ms(self, tree_tokens: int, context_tokens: int) -> float:
        return self.verify(tree_tokens, context_tokens) + self.iteration_overhead_ms

    def draft_ms(self, tokens: int) -> float:
        return self.draft_step(tokens) if tokens > 0 else 0.0

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill(tokens) if tokens > 0 else 0.0

    def baseline_ms(self) -> float:
        """Paper 000's recipe (BASELINE_BATCH, BASELINE_CONTEXT)."""
        if self.baseline_tpot_ms is not None:
            return float(self.baseline_tpot_ms)
        return self.verify_ms(BASELINE_BATCH, BASELINE_CONTEXT)


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (`llama-3.1-70b-tp4-a100`) or a YAML file path."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = PROFILE_DIR / f"{name_or_path}.yaml"
        if not shipped.is_file():
            names = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
            raise FileNotFoundError(
                f"hardware profile {str(name_or_path)!r}: no such file and no shipped "
                f"profile of that name (shipped: {names})"
            )
        path = shipped
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile is a YAML mapping")
    return HardwareProfile(**data)


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(profile.model_dump(), sort_keys=False))
