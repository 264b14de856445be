"""How long one target forward takes: the latency model batch formation spends time with.

The shape comes from a piecewise-linear curve of forward latency against the tokens it
carries (measured at startup, read off a hardware profile, or a knee-shaped prior from
the settings). Decode forwards are predicted from what they measured; what prefill
chunks add, from the curve times a drift factor learned from the forwards that carried
chunks, so the model follows a host whose speed changes under it (other processes,
thermal limits). The factor is an exponentially weighted mean in log space: a chunk
twice as slow as predicted moves it by a fixed fraction of a doubling, whatever the
scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear through (xs, ys): clamped below the first point, continuing the
    last segment beyond the last (a forward twice as large costs about twice as much;
    a falling last segment, noise in a measured table, is held flat)."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


@dataclass(frozen=True)
class Curve:
    """Forward latency in ms against the number of new tokens it carries (measured at the
    start of a sequence), plus what prefill chunks deeper into their prompts pay for
    attention: `context_ms` per thousand (query, earlier prompt token) pairs
    (`batching.chunk_context`)."""

    tokens: tuple[float, ...]
    ms: tuple[float, ...]
    context_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.ms):
            raise ValueError("latency curve: tokens and ms must be non-empty and equal length")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError(f"latency curve: tokens must increase, got {self.tokens}")
        if any(not (m >= 0 and math.isfinite(m)) for m in self.ms):
            raise ValueError("latency curve: ms must be finite and >= 0")

    def __call__(self, tree_tokens: int, prefill_tokens: int, context: float = 0.0) -> float:
        n = float(tree_tokens + prefill_tokens)
        return interp(n, self.tokens, self.ms) + self.context_ms * context

    @staticmethod
    def knee(step_ms: float, budget: int) -> Curve:
        """The prior without a measurement: a forward costs `step_ms` up to the knee
        budget B and grows linearly past it (B is defined as where the verify curve
        starts to rise)."""
        b = float(max(budget, 1))
        if b == 1.0:  # the knee is the first point: (1, 1, 2) would repeat a token count
            return Curve((1.0, 2.0), (step_ms, 2.0 * step_ms))
        return Curve((1.0, b, 2.0 * b), (step_ms, step_ms, 2.0 * step_ms))


@dataclass
class ForwardLatency:
    """Predicted ms of a forward over (tree tokens, prefill tokens, prefill context in
    thousands of pairs, `batching.chunk_context`).

    A decode forward's time is what such forwards measured (an EWMA per power-of-two
    tree-token bucket, seeded from `base`): the trees' own context, the backend and the
    host are all in it. What prefill chunks add is `base`'s marginal cost of the chunk
    tokens times a drift factor learned from the forwards that carried chunks (their
    time beyond the decode part): so one model serves both, and neither's error leaks
    into the other."""

    base: Callable[[int, int, float], float]
    alpha: float = 0.3  # weight of each new observation
    _decode: BucketedEWMA = field(init=False, repr=False)
    _log_drift: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._decode = BucketedEWMA(self.alpha)

    @property
    def drift(self) -> float:
        """Measured / modelled cost of prefill chunks."""
        return math.exp(self._log_drift)

    def decode_ms(self, tree_tokens: int) -> float:
        if tree_tokens <= 0:
            return 0.0
        return self._decode.get(tree_tokens, self.base(tree_tokens, 0, 0.0))

    def prefill_ms(self, tree_tokens: int, prefill_tokens: int, context: float = 0.0) -> float:
        """What `prefill_tokens` add to a forward of `tree_tokens` (all of it without)."""
        if prefill_tokens <= 0:
            return 0.0
        return self._marginal(tree_tokens, prefill_tokens, context) * self.drift

    def predict_ms(self, tree_tokens: int, prefill_tokens: int = 0, context: float = 0.0) -> float:
        return self.decode_ms(tree_tokens) + self.prefill_ms(tree_tokens, prefill_tokens, context)

    def observe(self, tree_tokens: int, prefill_tokens: int, context: float, ms: float) -> None:
        if not (ms > 0 and math.isfinite(ms)):
            return
        if prefill_tokens <= 0:
            self._decode.observe(tree_tokens, ms)
            return
        expected = self._marginal(tree_tokens, prefill_tokens, context)
        if expected <= 0:
            return
        # The chunks' share: the forward's time beyond its decode part, floored so a
        # noisy decode estimate cannot drive the factor to zero.
        extra = max(ms - self.decode_ms(tree_tokens), 0.1 * expected)
        self._log_drift = ewma(self._log_drift, math.log(extra / expected), self.alpha)

    def _marginal(self, tree_tokens: int, prefill_tokens: int, context: float) -> float:
        """What the chunks add on `base`, never below 0: a measured curve need not rise
        everywhere (a launch-bound GPU's is flat with noise, and a mixed-forward table
        may extrapolate below the verify curve), and a chunk that seemed to make a
        forward faster, times a large learned drift, predicted iterations of negative
        length: the selection refused them and the iteration's requests failed."""
        full = self.base(tree_tokens, prefill_tokens, context)
        if tree_tokens <= 0:
            return full
        return max(full - self.base(tree_tokens, 0, 0.0), 0.0)


def ewma(mean: float, value: float, alpha: float) -> float:
    """An exponentially weighted mean moved toward `value` by `alpha`."""
    return mean + alpha * (value - mean)


@dataclass
class BucketedEWMA:
    """An exponentially weighted mean of a time per power-of-two token-count bucket:
    iterations of 5 and 8 tokens cost about the same, so they share one estimate, and a
    bucket not measured yet answers with the caller's prior."""

    alpha: float = 0.3  # weight of each new observation
    _ms: dict[int, float] = field(default_factory=dict, repr=False)

    def get(self, tokens: int, prior: float) -> float:
        return self._ms.get(_bucket(tokens), prior)

    def observe(self, tokens: int, ms: float) -> None:
        bucket = _bucket(tokens)
        self._ms[bucket] = ewma(self._ms.get(bucket, ms), ms, self.alpha)


def _bucket(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))
