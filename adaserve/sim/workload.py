"""Workloads: request classes with SLOs and length distributions, and an arrival process.

A workload is YAML (see `workloads/adaserve-eurosys.yaml`). `Workload.generate` turns it
into a list of `SimRequest`s, deterministic for a seed. The same requests drive the
simulator and the load generator (`adaserve bench serve`), so both runs can be compared
request by request.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from adaserve.config import SLOClass
from adaserve.sim.acceptance import AcceptanceSettings, DraftShape


class LengthDist(BaseModel):
    """Token counts. lognormal: `mean` and `sigma` (sd of log length); uniform: [min,
    max]; constant: `mean`; empirical: uniform over `values`. Always clipped to [min, max]."""

    model_config = ConfigDict(extra="forbid")
    dist: Literal["lognormal", "uniform", "constant", "empirical"] = "lognormal"
    mean: PositiveFloat | None = None
    sigma: float = Field(default=0.5, ge=0.0)
    min: PositiveInt = 1
    max: PositiveInt = 4096
    values: list[PositiveInt] | None = None

    @model_validator(mode="after")
    def _check(self) -> LengthDist:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) exceeds max ({self.max})")
        if self.dist in ("lognormal", "constant") and self.mean is None:
            raise ValueError(f"dist {self.dist!r} needs a mean")
        if self.dist == "empirical" and not self.values:
            raise ValueError("dist 'empirical' needs values")
        return self

    def sample(self, size: int, rng: np.random.Generator) -> np.ndarray:
        if self.dist == "lognormal":
            assert self.mean is not None  # _check: lognormal needs a mean
            # mean of the lognormal = exp(mu + sigma^2 / 2)
            mu = math.log(self.mean) - self.sigma**2 / 2
            x = rng.lognormal(mu, self.sigma, size=size)
        elif self.dist == "uniform":
            x = rng.integers(self.min, self.max + 1, size=size)
        elif self.dist == "constant":
            x = np.full(size, self.mean)
        else:
            x = rng.choice(np.asarray(self.values), size=size)
        return np.clip(np.rint(x), self.min, self.max).astype(np.int64)


class RequestClass(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight: float = Field(ge=0.0)
    slo: SLOClass
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    draft: DraftShape = Field(default_factory=DraftShape)
    # Every prompt of the class starts with the same this-many tokens (a shared system
    # prompt): the prefix cache serves them after the first. The rest is the request's own.
    shared_prefix_tokens: int = Field(default=0, ge=0)
    # "output": max_tokens is the sampled output length. "context": requests send no
    # max_tokens (the rest of the context window, as a chat often does) and end on their
    # own, with eos, after the sampled output length: what a KV reservation must cover.
    max_tokens: Literal["output", "context"] = "output"
    # piecewise arrivals: [[fraction of the trace, relative rate], ...], linear between
    # points; normalized so the class's mean rate stays weight * rps.
    rate_profile: list[tuple[float, float]] | None = None


class Arrivals(BaseModel):
    model_config = ConfigDict(extra="forbid")
    process: Literal["poisson", "gamma", "piecewise", "trace"] = "poisson"
    cv: PositiveFloat = 1.0  # gamma: coefficient of variation of inter-arrival times
    trace: str | None = None  # trace: file of arrival timestamps (s), rescaled to rps


class SweepSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policies: list[str] = Field(
        default_factory=lambda: [
            "adaserve",
            "equal",
            "global",
            "spec-2",
            "spec-4",
            "specinfer",
            "cb",
            "cb-priority",
        ]
    )
    rps: list[PositiveFloat] = Field(default_factory=lambda: [2.6, 3.0, 3.4, 3.8, 4.2, 4.6])
    urgent: list[float] = Field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    slo_scale: list[PositiveFloat] = Field(default_factory=lambda: [0.6, 0.8, 1.0, 1.2, 1.4, 1.6])
    urgent_class: str = "coding"
    fixed_rps: PositiveFloat = 4.0  # urgent and slo-scale sweeps run at this rate
    slo_scale_urgent: float = Field(default=0.6, ge=0.0, le=1.0)
    duration_s: PositiveFloat | None = None  # None -> the workload's duration


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    profile: str  # shipped profile name or YAML path (relative to the workload file)
    rps: PositiveFloat = 1.0
    duration_s: PositiveFloat = 600.0
    seed: int = 0
    units: PositiveInt = 1  # serving units (verifier replicas) behind a least-loaded router
    arrivals: Arrivals = Field(default_factory=Arrivals)
    classes: dict[str, RequestClass] = Field(min_length=1)
    acceptance: AcceptanceSettings = Field(default_factory=AcceptanceSettings)
    settings: dict[str, Any] = Field(default_factory=dict)  # adaserve Settings overrides
    sweeps: SweepSettings = Field(default_factory=SweepSettings)
    base_dir: Path | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if sum(c.weight for c in self.classes.values()) <= 0:
            raise ValueError("class weights must not all be zero")
        if self.arrivals.process == "trace" and not self.arrivals.trace:
            raise ValueError("arrivals.process 'trace' needs arrivals.trace (a timestamp file)")
        return self

    def resolve(self, path: str | None) -> Path | None:
        if path is None:
            return None
        p = Path(path)
        if not p.is_absolute() and self.base_dir is not None and (self.base_dir / p).exists():
            return self.base_dir / p
        return p

    # ---- variants used by the sweeps ------------------------------------------------

    def with_urgent(self, fraction: float, urgent: str) -> Workload:
        """The `urgent` class gets `fraction` of the requests; the others share the rest
        in their original proportions."""
        if urgent not in self.classes:
            raise ValueError(f"urgent class {urgent!r} is not in the workload")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"urgent fraction must be in [0, 1], got {fraction}")
        rest = sum(c.weight for n, c in self.classes.items() if n != urgent)
        classes = {}
        for n, c in self.classes.items():
            if n == urgent:
                w = fraction
            else:
                w = (1.0 - fraction) * (c.weight / rest if rest > 0 else 0.0)
            classes[n] = c.model_copy(update={"weight": w})
        return self.model_copy(update={"classes": classes})

    def with_slo_scale(self, scale: float, urgent: str) -> Workload:
        """The `urgent` class's SLO becomes `scale` x the baseline latency."""
        if urgent not in self.classes:
            raise ValueError(f"urgent class {urgent!r} is not in the workload")
        c = self.classes[urgent]
        classes = dict(self.classes)
        slo = SLOClass(baseline_scale=scale, ttft_ms=c.slo.ttft_ms)
        classes[urgent] = c.model_copy(update={"slo": slo})
        return self.model_copy(update={"classes": classes})

    # ---- trace generation -----------------------------------------------------------

    def generate(
        self, rps: float, duration_s: float, seed: int, baseline_tpot_ms: float
    ) -> list[SimRequest]:
        if not (rps > 0 and math.isfinite(rps)):
            raise ValueError(f"rps must be a positive number, got {rps}")
        if not (duration_s > 0 and math.isfinite(duration_s)):
            raise ValueError(f"duration must be a positive number of seconds, got {duration_s}")
        rng = np.random.default_rng(seed)
        names = list(self.classes)
        weights = np.array([self.classes[n].weight for n in names], dtype=np.float64)
        weights /= weights.sum()
        times, cls = self._arrivals(rps, duration_s, names, weights, rng)
        out: list[SimRequest] = []
        for k, name in enumerate(names):
            idx = np.nonzero(cls == k)[0]
            c = self.classes[name]
            prompts = c.prompt_tokens.sample(len(idx), rng)
            outputs = c.output_tokens.sample(len(idx), rng)
            slo = c.slo.resolve_ms(baseline_tpot_ms)
            for i, p, o in zip(idx, prompts, outputs, strict=True):
                out.append(
                    SimRequest(
                        f"r{i:06d}",
                        float(times[i]),
                        name,
                        int(p),
                        int(o),
                        slo,
                        c.slo.ttft_ms,
                        c.shared_prefix_tokens,
                        c.max_tokens == "context",
                    )
                )
        out.sort(key=lambda r: (r.arrival_s, r.id))
        return out

    def _arrivals(self, rps, duration_s, names, weights, rng) -> tuple[np.ndarray, np.ndarray]:
        proc = self.arrivals.process
        if proc == "piecewise":
            return _piecewise(self, rps, duration_s, names, weights, rng)
        if proc == "trace":
            times = _trace_times(self.resolve(self.arrivals.trace), rps, duration_s)
        else:
            n_max = int(rps * duration_s * 1.5 + 20 * math.sqrt(rps * duration_s) + 20)
            if proc == "poisson":
                gaps = rng.exponential(1.0 / rps, size=n_max)
            else:  # gamma with mean 1/rps and the requested coefficient of variation
                shape = 1.0 / self.arrivals.cv**2
                gaps = rng.gamma(shape, 1.0 / (rps * shape), size=n_max)
            times = np.cumsum(gaps)
            times = times[times < duration_s]
        cls = rng.choice(len(names), size=len(times), p=weights)
        return times, cls


@dataclass(frozen=True)
class SimRequest:
    id: str
    arrival_s: float
    slo_class: str
    prompt_tokens: int
    output_tokens: int
    tpot_slo_ms: float
    ttft_slo_ms: float | None = None
    shared_prefix_tokens: int = 0  # of prompt_tokens, the class's common start
    open_ended: bool = False  # max_tokens: context (ends with eos after output_tokens)

    def prompt_ids(self, vocab_size: int) -> tuple[int, ...]:
        """Token ids of the prompt, deterministic per request: the class's shared
        start, then ids of the request's own (so prefix caching sees what real prompts
        would give it: nothing shared but a configured system prompt)."""
        shared = min(self.shared_prefix_tokens, self.prompt_tokens)
        head = np.random.default_rng(zlib.crc32(self.slo_class.encode())).integers(
            1, vocab_size, size=shared
        )
        tail = np.random.default_rng(zlib.crc32(self.id.encode())).integers(
            1, vocab_size, size=self.prompt_tokens - shared
        )
        return tuple(int(t) for t in np.concatenate([head, tail]))


def _piecewise(wl: Workload, rps, duration_s, names, weights, rng):
    """Each class is its own non-homogeneous Poisson process (thinning), so categories
    can peak at different times (paper 001, Fig. 13)."""
    all_t, all_c = [], []
    for k, name in enumerate(names):
        mean_rate = rps * weights[k]
        if mean_rate <= 0:
            continue
        prof = wl.classes[name].rate_profile or [(0.0, 1.0), (1.0, 1.0)]
        xs = np.array([p[0] for p in prof], dtype=np.float64)
        ys = np.array([p[1] for p in prof], dtype=np.float64)
        if np.any(np.diff(xs) <= 0) or np.any(ys < 0) or xs[0] > 0 or xs[-1] < 1:
            raise ValueError(
                f"class {name}: rate_profile needs increasing fractions covering [0, 1] "
                "and rates >= 0"
            )
        grid = np.linspace(0.0, 1.0, 1001)
        mean_shape = float(np.interp(grid, xs, ys).mean())
        if mean_shape <= 0:
            continue
        peak = mean_rate * ys.max() / mean_shape
        n = rng.poisson(peak * duration_s)
        t = np.sort(rng.uniform(0.0, duration_s, size=n))
        keep = (
            rng.uniform(0.0, peak, size=n)
            < mean_rate * np.interp(t / duration_s, xs, ys) / mean_shape
        )
        all_t.append(t[keep])
        all_c.append(np.full(int(keep.sum()), k))
    if not all_t:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    t = np.concatenate(all_t)
    c = np.concatenate(all_c)
    order = np.argsort(t, kind="stable")
    return t[order], c[order]


def _trace_times(path: Path | None, rps: float, duration_s: float) -> np.ndarray:
    if path is None or not path.is_file():
        raise FileNotFoundError(f"arrival trace not found: {path}")
    raw = np.sort(np.loadtxt(path, dtype=np.float64, ndmin=1))
    if raw.size < 2:
        raise ValueError(f"{path}: an arrival trace needs at least two timestamps")
    t = raw - raw[0]
    # Rescale the recorded trace so its mean rate is `rps`, then truncate.
    t = t * (len(t) / max(t[-1], 1e-9)) / rps
    return t[t < duration_s]


def load_workload(path: str | Path) -> Workload:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"workload file not found: {p}")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a workload is a YAML mapping")
    wl = Workload(**data)
    wl.base_dir = p.resolve().parent
    return wl
