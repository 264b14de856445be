"""How confident the modelled drafter is, and how often the modelled target agrees.

Two halves, both per tree node:

- a *draft distribution*: the drafter's top-k conditional probabilities q at a node
  (what beam search sees), per request class;
- a *calibration* g(q): the probability that the target's choice at the parent is this
  child. Children of one node are mutually exclusive (the target picks one token), so
  a node v is accepted with probability prod g(q) along its path. With g(q) = q that is
  exactly the papers' approximation f(v); `scale`, `exponent` and `noise` model a
  drafter whose probabilities are misaligned with the target.

Replay mode takes both halves from a trace recorded on the real runtime
(`adaserve.sim.record`): the q vectors are resampled as recorded, g is the empirical
acceptance rate per q bin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

# Smallest conditional probability a drafted node carries: keeps log q finite.
Q_FLOOR = 1e-6


class DraftShape(BaseModel):
    """Synthetic drafter confidence: top-1 probability ~ Beta(top1_alpha, top1_beta);
    each further rank takes a Beta(tail_alpha, tail_beta) share of what is left."""

    model_config = ConfigDict(extra="forbid")
    top1_alpha: PositiveFloat = 2.0
    top1_beta: PositiveFloat = 0.6
    tail_alpha: PositiveFloat = 1.2
    tail_beta: PositiveFloat = 1.8


class AcceptanceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["calibrated", "replay"] = "calibrated"
    # calibrated: g(q) = clip(scale * q ** exponent) with N(0, noise) added in logit space
    scale: float = Field(default=1.0, gt=0.0, le=1.0)
    exponent: PositiveFloat = 1.0
    noise: float = Field(default=0.0, ge=0.0)
    trace: str | None = None  # replay: JSONL written by `adaserve.sim.record`
    bins: int = Field(default=20, ge=2, le=1000)


class Calibration(Protocol):
    def __call__(self, q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """P(target picks this child | parent accepted) for each q: float64, in [0, 1]."""
        ...


class DraftSampler(Protocol):
    def __call__(self, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
        """float64 [rows, k]: a node's top-k conditional probabilities, descending,
        each row summing to at most 1."""
        ...


@dataclass(frozen=True)
class CalibratedAcceptance:
    scale: float = 1.0
    exponent: float = 1.0
    noise: float = 0.0

    def __call__(self, q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        g = self.scale * np.power(np.clip(q, 0.0, 1.0), self.exponent)
        if self.noise > 0.0 and g.size:
            g = np.clip(g, 1e-9, 1 - 1e-9)
            logit = np.log(g) - np.log1p(-g) + rng.normal(0.0, self.noise, size=g.shape)
            g = 1.0 / (1.0 + np.exp(-logit))
        return np.clip(g, 0.0, 1.0)


@dataclass(frozen=True)
class BetaDraft:
    shape: DraftShape

    def __call__(self, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
        s = self.shape
        out = np.empty((rows, k), dtype=np.float64)
        out[:, 0] = rng.beta(s.top1_alpha, s.top1_beta, size=rows)
        left = 1.0 - out[:, 0]
        for j in range(1, k):
            out[:, j] = left * rng.beta(s.tail_alpha, s.tail_beta, size=rows)
            left = left - out[:, j]
        out = np.maximum(-np.sort(-out, axis=1), Q_FLOOR)  # a weak top-1 can be outranked
        return out / np.maximum(out.sum(axis=1), 1.0)[:, None]  # the floor must not add mass


@dataclass(frozen=True)
class TraceRecord:
    probs: tuple[float, ...]  # the drafter's top-k conditional probabilities, descending
    chosen: int  # index of the child the target picked, -1 for none of them
    full: bool = True  # the node kept its whole top-k (beam search may prune children)


def load_trace(path: str | Path) -> list[TraceRecord]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"acceptance trace not found: {p}")
    records = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            probs = tuple(float(x) for x in obj["probs"])
            chosen = int(obj["chosen"])
            full = bool(obj.get("full", True))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{p}:{lineno}: bad trace record ({exc})") from exc
        if not probs or chosen < -1 or chosen >= len(probs):
            raise ValueError(f"{p}:{lineno}: need probs non-empty and -1 <= chosen < len(probs)")
        records.append(TraceRecord(probs, chosen, full))
    if not records:
        raise ValueError(f"{p}: the acceptance trace is empty")
    return records


@dataclass(frozen=True)
class ReplayAcceptance:
    """g(q) = the recorded acceptance rate of children whose q fell in the same bin."""

    edges: np.ndarray  # float64 [bins + 1] over [0, 1]
    rates: np.ndarray  # float64 [bins]

    @staticmethod
    def from_records(records: list[TraceRecord], bins: int = 20) -> ReplayAcceptance:
        q = np.array([x for r in records for x in r.probs])
        hit = np.array([i == r.chosen for r in records for i in range(len(r.probs))], dtype=float)
        edges = np.linspace(0.0, 1.0, bins + 1)
        idx = np.clip(np.searchsorted(edges, q, side="right") - 1, 0, bins - 1)
        count = np.bincount(idx, minlength=bins)
        accepted = np.bincount(idx, weights=hit, minlength=bins)
        # An empty bin falls back to f(v) = q at its centre: the papers' approximation.
        centre = (edges[:-1] + edges[1:]) / 2
        rates = np.where(count > 0, accepted / np.maximum(count, 1), centre)
        return ReplayAcceptance(edges, rates)

    def __call__(self, q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        idx = np.clip(np.searchsorted(self.edges, q, side="right") - 1, 0, len(self.rates) - 1)
        return self.rates[idx]


@dataclass(frozen=True)
class ReplayDraft:
    """Resamples recorded top-k vectors (padded with Q_FLOOR when k exceeds a record)."""

    table: np.ndarray  # float64 [records, k_max]

    @staticmethod
    def from_records(records: list[TraceRecord]) -> ReplayDraft:
        # Pruned nodes hold only a prefix of their top-k: sample whole vectors only.
        records = [r for r in records if r.full] or records
        k_max = max(len(r.probs) for r in records)
        table = np.full((len(records), k_max), Q_FLOOR)
        for i, r in enumerate(records):
            table[i, : len(r.probs)] = sorted(r.probs, reverse=True)
        return ReplayDraft(np.maximum(table, Q_FLOOR))

    def __call__(self, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
        picked = self.table[rng.integers(0, self.table.shape[0], size=rows)]
        if k <= picked.shape[1]:
            return picked[:, :k]
        pad = np.full((rows, k - picked.shape[1]), Q_FLOOR)
        return np.concatenate([picked, pad], axis=1)


def build_acceptance(
    settings: AcceptanceSettings, base_dir: Path | None = None
) -> tuple[Calibration, DraftSampler | None]:
    """(calibration, replay drafter or None: then each class's DraftShape applies)."""
    if settings.mode == "calibrated":
        return CalibratedAcceptance(settings.scale, settings.exponent, settings.noise), None
    if not settings.trace:
        raise ValueError("acceptance.mode 'replay' needs acceptance.trace (a recorded JSONL)")
    path = Path(settings.trace)
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    records = load_trace(path)
    return ReplayAcceptance.from_records(records, settings.bins), ReplayDraft.from_records(records)
