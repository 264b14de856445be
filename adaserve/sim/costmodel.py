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
    draft_prefill: {tokens: [512, 2048], ms: [9, 21]}   # optional: the drafter's prompt
                                                        # forward (its ingestion)
    prefill: {tokens: [1, 1024, 8192], ms: [28, 205, 1560]}    # target prefill
    kv_capacity_tokens: 500000
    iteration_overhead_ms: 0.5   # host work per iteration, added to every verify
    speed_trace:     # optional: the hardware's slowdown over simulated time
      - {t_s: 0, verify: 1.1, draft: 1.3, prefill: 0.9}
      - {t_s: 10, verify: 1.6, draft: 2.0, prefill: 1.4}

Between points latency is linear; beyond the last point it continues the last segment
(a forward twice as large costs about twice as much; a falling last segment, noise in a
measured table, is held flat), below the first it is clamped; except that a mixed
forward's chunk smaller than the `mixed` table's first column is read off the line from
the plain verify of its trees (no chunk) to that column. A drafter forward larger
than `draft_step`'s last point (a prompt chunk it ingests) continues along
`draft_prefill`'s slope where the profile has it: the draft-step table is measured at
tree sizes (CUDA-graphed on a GPU), and its last segment says little about a forward of
a thousand prompt tokens.

`speed_trace` is piecewise constant: each entry's factors hold from its `t_s` (seconds
of simulated time since the trace starts) until the next entry's; before the first
entry, and without the field, every factor is 1. A verify, a draft step or a prefill
that starts at simulated time t costs its table's latency times the factor in force at
t (a factor left out of an entry is 1). `iteration_overhead_ms` is not scaled. Planning
constants (the SLO baseline, the draft cost in verify tokens) read the tables alone.
`validate_cpu.py` fits such a trace to a drifting host.
"""

from __future__ import annotations

import bisect
import itertools
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from adaserve.latency import interp
from adaserve.timing import BASELINE_BATCH, BASELINE_CONTEXT

PROFILE_DIR = Path(__file__).parent / "profiles"


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
        return interp(float(tokens), self.tokens, self.ms)


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
        rows = [interp(float(tokens), self.tokens, row) for row in self.ms]
        return max(0.0, interp(float(context), self.context, rows))


def _check_axis(name: str, xs: list[float]) -> None:
    if any(not np.isfinite(x) or x < 0 for x in xs):
        raise ValueError(f"{name} must be finite and >= 0")
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise ValueError(f"{name} must be strictly increasing, got {xs}")


Phase = Literal["verify", "draft", "prefill"]


class SpeedPoint(BaseModel):
    """One entry of a profile's `speed_trace`: cost factors from `t_s` on."""

    model_config = ConfigDict(extra="forbid")
    t_s: float = Field(ge=0.0, allow_inf_nan=False)
    verify: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    draft: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    prefill: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)


class MixedTable(BaseModel):
    """Measured latency of forwards carrying both tree tokens and prefill chunk tokens
    (`adaserve profile`): ms[i][j] for tree[i] tree tokens and prefill[j] chunk tokens,
    bilinear in both."""

    model_config = ConfigDict(extra="forbid")
    tree: list[float] = Field(min_length=1)
    prefill: list[float] = Field(min_length=1)
    ms: list[list[float]] = Field(min_length=1)  # [len(tree)][len(prefill)]

    @model_validator(mode="after")
    def _check(self) -> MixedTable:
        _check_axis("tree", self.tree)
        _check_axis("prefill", self.prefill)
        if len(self.ms) != len(self.tree) or any(len(r) != len(self.prefill) for r in self.ms):
            raise ValueError(
                "mixed.ms must have one row per tree value and one column per prefill value"
            )
        if any(not (m >= 0 and np.isfinite(m)) for row in self.ms for m in row):
            raise ValueError("latencies must be finite and >= 0")
        return self

    def __call__(self, tree: float, prefill: float) -> float:
        rows = [interp(float(prefill), self.prefill, row) for row in self.ms]
        return max(0.0, interp(float(tree), self.tree, rows))


class HardwareProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    target: str = ""
    drafter: str = ""
    verify: Surface
    draft_step: Curve
    prefill: Curve
    # The drafter's forward over prompt tokens (ingesting a chunk), measured past the
    # draft step's sizes; None -> the draft_step curve continued (draft_forward_ms).
    draft_prefill: Curve | None = None
    # Forwards mixing tree tokens and prefill chunks; None -> derived from verify and
    # prefill (HardwareProfile.forward_ms).
    mixed: MixedTable | None = None
    # Host-side work per iteration not covered by the tables (scheduling, sampling).
    iteration_overhead_ms: float = Field(default=0.0, ge=0.0)
    kv_capacity_tokens: PositiveInt = 500_000
    max_model_len: PositiveInt = 32768
    vocab_size: PositiveInt = 128_256
    budget: PositiveInt = 256  # verifier tokens per iteration (the knee), engine default
    # Per-token latency of plain decoding at near-zero load; None -> derived (below).
    baseline_tpot_ms: PositiveFloat | None = None
    # The hardware's slowdown over simulated time (module docstring); empty: none.
    speed_trace: list[SpeedPoint] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_trace(self) -> HardwareProfile:
        times = [p.t_s for p in self.speed_trace]
        if any(b <= a for a, b in itertools.pairwise(times)):
            raise ValueError(f"speed_trace t_s must be strictly increasing, got {times}")
        return self

    def speed(self, phase: Phase, at_s: float | None) -> float:
        """The factor on `phase`'s cost at simulated time `at_s` (None: untimed, 1)."""
        if at_s is None or not self.speed_trace:
            return 1.0
        i = bisect.bisect_right(self.speed_trace, at_s, key=lambda p: p.t_s)
        return getattr(self.speed_trace[i - 1], phase) if i else 1.0

    def verify_ms(self, tree_tokens: int, context_tokens: int, at_s: float | None = None) -> float:
        table = self.verify(tree_tokens, context_tokens)
        return table * self.speed("verify", at_s) + self.iteration_overhead_ms

    def draft_ms(self, tokens: int, at_s: float | None = None) -> float:
        return self.draft_step(tokens) * self.speed("draft", at_s) if tokens > 0 else 0.0

    def draft_forward_ms(self, tokens: int, at_s: float | None = None) -> float:
        """One drafter forward over `tokens` new tokens, prompt chunks included: the
        draft-step table up to its last point, past it the last point plus the rise of
        `draft_prefill` from there (without that curve: draft_ms)."""
        last = self.draft_step.tokens[-1]
        if self.draft_prefill is None or tokens <= last:
            return self.draft_ms(tokens, at_s)
        rise = max(self.draft_prefill(tokens) - self.draft_prefill(last), 0.0)
        return (self.draft_step(last) + rise) * self.speed("draft", at_s)

    def prefill_ms(self, tokens: int, at_s: float | None = None) -> float:
        return self.prefill(tokens) * self.speed("prefill", at_s) if tokens > 0 else 0.0

    def forward_ms(
        self, tree_tokens: int, prefill_tokens: int, context_tokens: int, at_s: float | None = None
    ) -> float:
        """One target forward over the selected trees (with `context_tokens` cached
        behind them) and prefill chunks: a verify without chunks, a prefill without
        trees, and for a mixed forward the measured `mixed` table (plus the trees'
        context cost from the verify surface), or else the verify surface continued
        past its last token count along the prefill curve's slope."""
        if prefill_tokens <= 0:
            return self.verify_ms(tree_tokens, context_tokens, at_s)
        if tree_tokens <= 0:
            return self.prefill_ms(prefill_tokens, at_s)
        table = self.mixed_table_ms(tree_tokens, prefill_tokens, context_tokens)
        return table * self.speed("verify", at_s) + self.iteration_overhead_ms

    def mixed_table_ms(self, tree_tokens: int, prefill_tokens: int, context_tokens: int) -> float:
        """A mixed forward's latency from the tables alone (no speed trace, no
        overhead): what the engine's latency model starts from in the simulator."""
        if self.mixed is not None:
            ctx = self.verify(tree_tokens, context_tokens) - self.verify(tree_tokens, 0)
            first = self.mixed.prefill[0]
            table = self.mixed(tree_tokens, prefill_tokens)
            if prefill_tokens < first:
                # Below the first measured chunk the forward shrinks toward the plain
                # verify of its trees, linearly (measured on the served CPU pair: 4 tree
                # tokens beside 1/4/8/12 prompt tokens cost within 7% of this line, where
                # clamping charged an 8-token chunk as a 16-token one, +44%).
                plain = self.verify(tree_tokens, 0)
                table = plain + (table - plain) * prefill_tokens / first
            return table + max(0.0, ctx)
        n = tree_tokens + prefill_tokens
        top = self.verify.tokens[-1]
        if n <= top:
            return self.verify(n, context_tokens)
        return self.verify(top, context_tokens) + max(0.0, self.prefill(n) - self.prefill(top))

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
    data = profile.model_dump()
    if not data["speed_trace"]:  # a measured profile has none: keep the file as it was
        del data["speed_trace"]
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
