"""Batch formation: what one iteration's forward carries (torch-free, no clock reads).

Every iteration runs one target forward holding the selected trees of the decoding
requests and prefill chunks of the prompts still being prefilled (SLOs-Serve's
`BatchForward`, paper 004; vLLM V1 and SGLang mix prefill and decode the same way).
`form_batch` splits the iteration's tokens in SLO order:

1. every decoding request gets its root, and the tree tokens its TPOT SLO needs: a
   request behind schedule needs A(r) > 1 tokens accepted this iteration, so it is
   reserved the drafted nodes a chain of the planned depth needs to expect that many
   (selection spends them; `adaserve/slo.py` has A(r));
2. prefill chunks in order of TTFT deadline (earliest first), as many tokens as fit in
   the iteration time the decoding requests' TPOT SLOs allow;
3. whatever the trees may still use, up to the knee budget B, goes to selection's
   throughput phase.

The iteration time the decoding requests allow is paced by their SLOs: no iteration
runs longer than the tightest TPOT SLO in the batch (every request emits at least its
bonus token per iteration, so its stream never waits longer than its SLO for a token;
SLOs-Serve's Algorithm 2 sets the batch latency the same way). The token count that
fits in that time is read off the forward's latency model, not a fixed chunk size.
While prompts wait, each iteration prefills at least `min_prefill_tokens`, so a steady
stream of tight requests slows prefill down but never stops it; earliest-deadline order
then serves every prompt, since deadlines are finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from adaserve.slo import required_accepted


@dataclass(frozen=True)
class Decoding:
    """A request past its prefill: it roots a tree this iteration."""

    id: str
    tpot_slo_ms: float
    elapsed_ms: float  # l_r: since its first token
    decoded: int  # o_r: tokens decoded since the first


@dataclass(frozen=True)
class Prefilling:
    """A request whose prompt is not all in the target's KV yet."""

    id: str
    remaining: int  # prompt tokens still to prefill, > 0
    deadline_ms: float  # its TTFT deadline on the engine clock; the prefill order
    priority: int = 0  # vLLM-style: lower first among equal deadlines
    arrival_ms: float = 0.0


@dataclass(frozen=True)
class BatchLimits:
    tree_budget: int  # B: the most tree tokens selection may verify (the verify knee)
    max_batch_tokens: int  # the most tokens one forward carries, trees and chunks
    min_prefill_tokens: int  # prefill progress per iteration while prompts wait
    depth: int = 0  # planned draft depth this iteration (0: no drafting)
    acceptance: float = 0.75  # per drafted token, for the SLO reservation


@dataclass(frozen=True)
class BatchPlan:
    chunks: tuple[tuple[str, int], ...]  # (request id, prompt tokens) in deadline order
    tree_budget: int  # tokens selection may spend on trees (>= one root per request)
    slo_tree_tokens: int  # tree tokens reserved for the decoding requests' SLOs
    time_limit_ms: float  # the iteration time the TPOT SLOs allow (inf: none decoding)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


# ms of one forward over (tree tokens, prefill tokens): the latency model's prediction.
ForwardCost = Callable[[int, int], float]


def form_batch(
    decoding: Sequence[Decoding],
    prefilling: Sequence[Prefilling],
    limits: BatchLimits,
    forward_ms: ForwardCost,
    overhead_ms: float = 0.0,
) -> BatchPlan:
    """The iteration's split of tokens. `overhead_ms`: the rest of the iteration outside
    the forward (drafting), which the TPOT pacing must leave room for."""
    n = len(decoding)
    slo_tokens = n + int(slo_draft_tokens(decoding, limits).sum())
    time_limit = min((d.tpot_slo_ms for d in decoding), default=math.inf)
    remaining = sum(p.remaining for p in prefilling)
    if remaining == 0:
        # Decode-only iteration: selection keeps the whole knee budget, as without
        # prefill (its own SLO and marginal-value rules decide what to verify).
        return BatchPlan((), max(limits.tree_budget, n), slo_tokens, time_limit)
    room = limits.max_batch_tokens - slo_tokens
    if n and math.isfinite(time_limit):
        fits = _max_prefill(forward_ms, slo_tokens, time_limit - overhead_ms, max(room, 0))
        prefill = max(fits, limits.min_prefill_tokens)
    else:
        prefill = room
    prefill = min(max(prefill, limits.min_prefill_tokens, 1), remaining)
    order = sorted(prefilling, key=lambda p: (p.deadline_ms, p.priority, p.arrival_ms, p.id))
    chunks = []
    for p in order:
        take = min(p.remaining, prefill)
        if take <= 0:
            break
        chunks.append((p.id, take))
        prefill -= take
    spent = sum(t for _, t in chunks)
    # Throughput trees get what the forward still holds within the time limit and the knee.
    tree_room = limits.tree_budget
    if n and math.isfinite(time_limit):
        tree_room = min(tree_room, _max_trees(forward_ms, spent, time_limit - overhead_ms))
    tree_budget = max(min(tree_room, limits.max_batch_tokens - spent), slo_tokens, n)
    return BatchPlan(tuple(chunks), tree_budget, slo_tokens, time_limit)


def slo_draft_tokens(decoding: Sequence[Decoding], limits: BatchLimits) -> np.ndarray:
    """Drafted nodes each request needs this iteration to stay on its TPOT SLO: the
    shortest chain whose expected accepted tokens, sum(alpha^j, j = 0..k), reach
    A_cap(r) = min(A(r), d + 1), with A(r) at an iteration as long as the pacing allows
    (the tightest SLO). int64 [n]; zeros without drafting."""
    n = len(decoding)
    if n == 0 or limits.depth <= 0:
        return np.zeros(n, dtype=np.int64)
    t = min(d.tpot_slo_ms for d in decoding)
    a = required_accepted(
        np.array([d.elapsed_ms for d in decoding]),
        np.array([d.decoded for d in decoding], dtype=np.float64),
        np.array([d.tpot_slo_ms for d in decoding]),
        t,
    )
    a_cap = np.minimum(a, limits.depth + 1)
    # expected[k] = tokens a k-deep chain yields on average (the root's bonus counts 1)
    expected = np.cumsum(limits.acceptance ** np.arange(limits.depth + 1))
    k = np.searchsorted(expected, a_cap - 1e-9)  # first k with expected[k] >= a_cap
    return np.minimum(k, limits.depth).astype(np.int64)


def _max_prefill(forward_ms: ForwardCost, trees: int, limit_ms: float, cap: int) -> int:
    """The most prefill tokens (<= cap) a forward with `trees` tree tokens carries
    within limit_ms: binary search on the (monotone) latency model."""
    lo, hi = 0, cap
    if forward_ms(trees, 0) > limit_ms:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if forward_ms(trees, mid) <= limit_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _max_trees(forward_ms: ForwardCost, prefill: int, limit_ms: float, cap: int = 4096) -> int:
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if forward_ms(mid, prefill) <= limit_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo


def ttft_attainable(
    prompt_tokens: int,
    queued_tokens: int,
    ttft_slo_ms: float,
    prefill_ms_per_token: float,
) -> bool:
    """Whether a prompt can reach its first token within its TTFT SLO: the prompt tokens
    of every request ahead of it in deadline order plus its own, at the best prefill
    rate this deployment reaches (a full batch of prompt tokens per forward). An
    optimistic test: what fails it can never be met; what passes may still be late."""
    return (queued_tokens + prompt_tokens) * prefill_ms_per_token <= ttft_slo_ms
