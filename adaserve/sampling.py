"""Per-request sampling of target logits, batched: temperature, top-k, top-p, seed.

Randomness is counter-based: the uniform that picks a request's t-th output token is a
hash of (request key, t). Three properties follow, all of which a per-request
`torch.Generator` stepped on every draw would lose:

* a seeded request gets the same tokens whatever else is in the batch;
* it gets the same tokens with or without speculation, whatever the tree shape, because
  tree verification uses exactly one uniform per emitted position (see verify.py);
* every node of a tree can be sampled in one batched call before the walk, since the
  uniform of a node depends only on its depth, not on which path the walk takes.

A token is drawn by inverse CDF over the filtered distribution in vocabulary order:
`y = min{i : cdf[i] > u * cdf[-1]}`, which never returns a zero-probability token.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch

from adaserve.request import SamplingParams

_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def request_key(seed: int | None) -> int:
    """The 64-bit RNG key of a request: its seed, or fresh entropy when unseeded."""
    return secrets.randbits(64) if seed is None else seed & _MASK64


def sequence_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence `index` of an n > 1 request: the request's own for 0, so
    choice 0 is what n = 1 gives; for the others a SplitMix64 mix of (seed, index),
    63 bits so it stays a valid int64 on every wire. Unseeded stays unseeded."""
    if seed is None or index == 0:
        return seed
    z = np.asarray([(seed + index * 0x9E3779B97F4A7C15) & _MASK64], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(_mix64(z)[0] >> np.uint64(1))


def _mix64(z: np.ndarray) -> np.ndarray:
    # SplitMix64 finalizer: a bijection on uint64 with full avalanche.
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(keys: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """float64 [n] in [0, 1): the uniform for output position `positions[i]` of key `keys[i]`."""
    k = np.asarray(keys, dtype=np.uint64).ravel()  # keys come from request_key: in [0, 2**64)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint64).ravel()
    if k.shape != p.shape:
        raise ValueError(f"uniforms: {k.shape[0]} keys but {p.shape[0]} positions")
    with np.errstate(over="ignore"):
        z = _mix64(_mix64(k + _GAMMA) + (p + np.uint64(1)) * _GAMMA)
    # 53 high bits -> an exactly representable double in [0, 1).
    return (z >> np.uint64(11)).astype(np.float64) * (2.0**-53)


def row_params(
    params: Sequence[SamplingParams],
    rows_per_request: Sequence[int] | np.ndarray,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature float32, top_k int64, top_p float32) tensors, each request's
    values repeated over its rows."""
    reps = torch.as_tensor(list(rows_per_request), dtype=torch.int64)
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    return tuple(t.repeat_interleave(reps).to(device) for t in (temp, top_k, top_p))  # type: ignore[return-value]


def row_min_p(
    params: Sequence[SamplingParams], rows_per_request: Sequence[int] | np.ndarray, device
) -> torch.Tensor | None:
    """Per-row min_p (float32), or None when no request uses it."""
    if not any(p.min_p for p in params):
        return None
    reps = torch.as_tensor(list(rows_per_request), dtype=torch.int64)
    return (
        torch.tensor([p.min_p for p in params], dtype=torch.float32)
        .repeat_interleave(reps)
        .to(device)
    )


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [N, V]: softmax(logits / T) without the tokens below min_p times the top
    probability (vLLM's order: min_p first), restricted to the top-k, then to the
    smallest prefix (by descending probability) whose mass reaches top-p, renormalized.

    logits [N, V]; temperature [N] (0 -> one-hot argmax); top_k [N] (0 -> off);
    top_p [N] in (0, 1]; min_p [N] in [0, 1] or None (off). Inputs are not modified.
    """
    if logits.dim() != 2:
        raise ValueError(f"filtered_probs: logits must be [N, V], got {tuple(logits.shape)}")
    vocab = logits.shape[1]
    logits = logits.float()
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / safe_t[:, None]
    if min_p is not None:
        # p_i < min_p * p_max  <=>  scaled_i < scaled_max + log(min_p): no softmax needed.
        top = scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled < top + torch.log(min_p)[:, None], float("-inf"))
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if bool(k_on.any()) or bool(p_on.any()):
        # One stable descending sort serves both filters; ties keep vocabulary order.
        sorted_vals, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device)
        k_eff = torch.where(k_on, top_k, torch.full_like(top_k, vocab))
        drop = rank[None, :] >= k_eff[:, None]
        sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
        probs_sorted = torch.softmax(sorted_vals, dim=-1)
        # Keep a token iff the mass strictly before it is below top_p: the first token
        # always survives, and the kept prefix is the smallest reaching top_p.
        mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        drop |= p_on[:, None] & (mass_before >= top_p[:, None])
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor | np.ndarray) -> torch.Tensor:
    """int64 [N]: inverse-CDF draw from each row of `probs` [N, V] with uniform u [N]."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    u = torch.as_tensor(u, dtype=torch.float64, device=probs.device)
    # Scaling by the row total absorbs the rounding of the cumulative sum.
    x = (u * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    return idx.clamp_max(probs.shape[1] - 1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[int],
    positions: Sequence[int],
) -> torch.Tensor:
    """int64 [N]: one token per row; row i uses params[i], key keys[i] at output
    position positions[i]. Greedy rows return the argmax."""
    temp, top_k, top_p = row_params(params, [1] * len(params), logits.device)
    min_p = row_min_p(params, [1] * len(params), logits.device)
    probs = filtered_probs(logits, temp, top_k, top_p, min_p)
    return sample_from_probs(probs, uniforms(keys, positions))


class TokenRng:
    """A request's random stream for sampling: the uniform for output position t is
    `uniforms([key], [t])`, and `position` counts the positions used so far.

    Verification advances it by exactly the number of tokens it emits, so a seeded
    request's stream, and therefore its output, does not depend on tree shapes.
    """

    __slots__ = ("key", "position")

    def __init__(self, seed: int | None = None, position: int = 0) -> None:
        self.key = request_key(seed)
        self.position = position

    def at(self, offsets: np.ndarray) -> np.ndarray:
        """float64 [k]: the uniforms of positions `position + offsets` (nothing advances)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        return uniforms(
            np.full(offsets.shape[0], self.key, dtype=np.uint64), self.position + offsets
        )

    def advance(self, n: int) -> None:
        self.position += n

    def __repr__(self) -> str:
        return f"TokenRng(key={self.key:#x}, position={self.position})"
