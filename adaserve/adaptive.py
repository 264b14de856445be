"""Speculation depth and width from the number of active requests.

- `eurosys` (paper 001, eq. 8-9):
      d = clip(floor(B1 / (n + c1)) - 1, D_min, D_max)
      w = clip(floor(B2 / n) + c2, 1, W_max)
  B1 (verifier tokens per step) and B2 (drafter tokens per step) default to the
  scheduler budget B.
- `v1` (paper 000, eq. 8-9): d = max(1, min(D_max, ceil(B / n))),
  w = max(1, min(W_max, floor(B / n))).
- `fixed`: (fixed_depth, fixed_width) whatever the load.

With `draft_cost_tokens` set, the eurosys and v1 depths are capped by `cost_depth`: the
chain depth that maximizes expected accepted tokens per unit of iteration time under the
budget's cost model. Eq. 8 alone (D_max 6 at light load) buys draft steps of ~5 ms each
for about one extra accepted token over four steps (benchmarks/sim/RESULTS.md).

Where no depth pays for the whole batch, `slack_plan` still drafts for its tightest-SLO
requests, at the depth that makes them fastest while the iteration it stretches keeps
every other request within `slack_margin` of its own SLO: their slack pays for the tight
requests' speed, which is the product (a batch of equal SLOs gets no such plan).

Where the tree budget cannot give every decoding request even one drafted token (more
decoding requests than B minus their number), the cap counts only the drafted tokens the
budget lets the verifier carry (`decoding`; policy adaserve): a draft step for the whole
batch buys at most B - n verified tokens there, and plain decoding (depth 0) is a
candidate whatever d_min, as it is where B leaves no token past the roots.

The cap counts the prompt tokens expected to ride along in the iteration as a fixed
cost (`prefill_tokens`; the engine passes them under policy adaserve where no TTFT SLO
waits on the prefill, `planner.riding_prefill`): the decoders wait for the chunk at any
depth, so a deeper chain keeps their TPOT where prefill runs beside them.

With `draft_stop_prob`, where the cost cap plans a chain of two or more steps the depth
is the policy's own (eq. 8 at light load reaches d_max) and the drafter stops each
request's beam search once none of its beams is likely enough to be accepted: the
per-iteration depth then follows the drafter's confidence (deep on code, shallow on open
prose) instead of one average acceptance.

With `learn_acceptance`, the cost model's acceptance is learned from the verifications
the engine has seen (`AcceptanceEstimate`), the setting being the prior: how often the
drafter agrees with the target depends on the workload (code and repetitive text far
more than the held-out chat prompts the setting was measured on).

With no active requests there is nothing to speculate for; every policy then answers
as it would for a single request, so the first request of an idle server is planned
for the lightest load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from adaserve.config import AdaptiveSettings

# SLOs within this factor of the tightest in the batch count as one (the tight) level:
# per-request SLOs need not come from a handful of classes.
TIGHT_LEVEL = 1.1
# The learned acceptance stays inside (0, 1): the cost model's geometric sums need
# alpha < 1, and a drafter estimated at 0 would never be measured again.
ALPHA_MIN, ALPHA_MAX = 0.05, 0.95


def plan_depth_width(
    n: int,
    budget: int,
    settings: AdaptiveSettings,
    prefill_tokens: int = 0,
    decoding: int | None = None,
) -> tuple[int, int]:
    """(depth, width) for n active requests and a verifier budget B: width >= 1, depth
    >= d_min (depth 0, with d_min = 0 or where the budget binds, is plain decoding for
    this iteration). `prefill_tokens`: prompt tokens expected to ride along in the
    iteration; `decoding`: the requests whose roots this iteration verifies, where the
    budget's room for drafted tokens should count (both cost_depth's)."""
    if n < 0:
        raise ValueError(f"n: number of active requests must be >= 0, got {n}")
    if budget < 1:
        raise ValueError(f"budget: must be a positive integer, got {budget}")
    n = max(n, 1)
    s = settings
    if s.policy == "fixed":
        return s.fixed_depth, s.fixed_width
    if s.policy == "v1":
        depth = max(1, min(s.d_max, -(-budget // n)))
        width = max(1, min(s.w_max, budget // n))
        return _capped(depth, cost_depth(n, budget, s, prefill_tokens, decoding), s), width
    b1 = s.b1 if s.b1 is not None else budget
    b2 = s.b2 if s.b2 is not None else budget
    # n + c1 <= 0 would divide by zero or flip the sign: treat it as the deepest plan.
    depth = b1 // (n + s.c1) - 1 if n + s.c1 > 0 else s.d_max
    depth = _clip(depth, s.d_min, max(s.d_min, s.d_max))
    width = _clip(b2 // n + s.c2, 1, s.w_max)
    return _capped(depth, cost_depth(n, budget, s, prefill_tokens, decoding), s), width


def _capped(depth: int, cap: int, s: AdaptiveSettings) -> int:
    """The policy's depth under the cost cap. With `draft_stop_prob`, where the cap
    finds a chain of two or more steps worth drafting, the drafter's own confidence ends
    each tree instead, up to the policy's depth. Where the cap plans one step or none
    it stands: there each step is paid by every request of a batch past the verifier's
    knee, and a confident request would draft deep at the whole batch's expense (3
    requests on the 2-core CPU: 0.88x plain with the cap lifted, 1.16x with it)."""
    if s.draft_stop_prob is not None and cap >= 2:
        return depth
    return min(depth, cap)


def cost_depth(
    n: int,
    budget: int,
    s: AdaptiveSettings,
    prefill_tokens: int = 0,
    decoding: int | None = None,
) -> int:
    """The chain depth d that maximizes expected accepted tokens per unit of iteration
    time, n * sum(alpha^j, j = 0..d) / (B + P + n * (d + 1) + d * (c + c_n * n)), with
    the budget's own cost model (B is the knee: a forward of N tree tokens costs about
    B + N token-units; a draft step costs c = draft_cost_tokens plus c_n =
    draft_cost_tokens_per_request per request); no cap when draft_cost_tokens is None.
    P = `prefill_tokens`, the prompt tokens riding along in the iteration: a fixed cost
    the decoders wait for whatever their depth, so the deeper chain it makes worth
    drafting is what keeps their TPOT where prefill runs beside them. At least d_min;
    with d_min = 0, plain decoding (d = 0) is a candidate too. `decoding`: where more
    requests decode than the budget has room for one drafted token each beside their
    roots, `budget_bound_depth` decides instead."""
    if s.draft_cost_tokens is None:
        return max(s.d_min, s.d_max)  # no cap (d_min wins where it exceeds d_max)
    if decoding is not None and decoding > budget - decoding:
        return budget_bound_depth(decoding, budget, s, prefill_tokens)
    d = np.arange(min(s.d_min, 1), max(s.d_min, s.d_max) + 1)
    cost = _iteration_cost(budget, n, n, d, s, s.draft_cost_tokens) + max(prefill_tokens, 0)
    rate = n * _chain_tokens(d, s) / cost
    return max(s.d_min, int(d[np.argmax(rate)]))


def budget_bound_depth(n: int, budget: int, s: AdaptiveSettings, prefill_tokens: int = 0) -> int:
    """cost_depth's choice for n decoding requests whose trees the budget B truncates:
    drafted d deep, they give the verifier n d tokens, of which selection keeps m =
    min(n d, B - n), best first, i.e. level by level (each level-j token is accepted
    with probability alpha^j). Expected tokens per verification n + sum of the kept
    tokens' alpha^j, over the iteration's cost B + n + m + d (c + c_n n) + P. Depth 0,
    plain decoding, is a candidate whatever d_min: a draft step that buys fewer
    verified tokens than its own cost is what the batch would pay for nothing."""
    if s.draft_cost_tokens is None:
        raise ValueError("budget_bound_depth needs the cost model (draft_cost_tokens)")
    n = max(n, 1)
    d = np.arange(0, max(s.d_min, s.d_max) + 1)
    kept = np.minimum(n * d, max(budget - n, 0))
    levels, rest = np.divmod(kept, n)
    # Full levels: each chain's expected tokens past its bonus one; then part of the next.
    accepted = n * (_chain_tokens(levels, s) - 1.0) + rest * s.acceptance ** (levels + 1)
    per_step = s.draft_cost_tokens + s.draft_cost_tokens_per_request * n
    cost = budget + n + kept + d * per_step + max(prefill_tokens, 0)
    return int(d[np.argmax((n + accepted) / cost)])


def ngram_pays(
    n: int, budget: int, tokens: np.ndarray | float, nodes: np.ndarray | float, host_units: float
) -> bool:
    """Whether verifying n-gram trees pays for a batch of n: a request's tree, emitting
    `tokens` per verification (bonus included) for `nodes` verified draft tokens, beats
    plain decoding in tokens per unit of iteration time by NGRAM_MARGIN,
    tokens / (B + n + n nodes + n h) > NGRAM_MARGIN / (B + n), in cost_depth's model (a
    forward of N tree tokens costs about B + N token-units). The n-gram drafter has no
    draft steps, but it is not free: h = host_units is its host time per request (the
    lookup, and selection over its trees) in those units. `tokens` and `nodes` may be
    arrays of candidates (chains of each depth, before any evidence): the best one
    counts."""
    rate = np.asarray(tokens, dtype=np.float64) / (
        budget + n + n * np.asarray(nodes, dtype=np.float64) + n * host_units
    )
    return bool(rate.max() > NGRAM_MARGIN / (budget + n))


# How much more an n-gram tree must promise than plain decoding (ngram_pays): its host
# time is certain and its tokens are not, and a batch's slowest request sets the pace
# of a round (BENCHMARKS.md, "Layouts").
NGRAM_MARGIN = 1.1


def _chain_tokens(d: np.ndarray, s: AdaptiveSettings) -> np.ndarray:
    """Expected tokens a depth-d chain emits per verification, bonus token included:
    sum(alpha^j, j = 0..d)."""
    return (1.0 - s.acceptance ** (d + 1)) / (1.0 - s.acceptance)


def _iteration_cost(
    budget: int, n: int, k: int, d: np.ndarray, s: AdaptiveSettings, draft_cost: float
) -> np.ndarray:
    """Token-units of an iteration of n requests, k of them drafted for d steps: the
    verify forward (B + n roots + k d tree tokens) plus d draft steps of c + c_n k each
    (c = draft_cost, the setting draft_cost_tokens, which the callers have checked)."""
    return budget + n + k * d + d * (draft_cost + s.draft_cost_tokens_per_request * k)


def slack_plan(
    slo_ms: np.ndarray, t_plain_ms: float, budget: int, s: AdaptiveSettings
) -> tuple[np.ndarray, int]:
    """(mask of requests to draft for, depth) for a batch whose plan is plain decoding.

    The tight requests are those within `TIGHT_LEVEL` of the batch's smallest SLO.
    Drafting k of them d steps deep stretches the iteration of a batch of n to about
    t_plain * (B + n + k d + d (c + c_n k)) / (B + n) under cost_depth's cost model, and
    each emits sum(alpha^j, j = 0..d) tokens for it. The depth is the one that makes the
    tight requests fastest, among those that keep the stretched iteration within
    slack_margin of every other request's SLO and that beat plain decoding for the tight
    ones; depth 0 (no plan) where none does, the batch has one SLO level, or the
    settings have no cost model or no margin."""
    n = len(slo_ms)
    none = np.zeros(n, dtype=bool), 0
    if s.slack_margin is None or s.draft_cost_tokens is None or n < 2:
        return none
    tight = slo_ms <= TIGHT_LEVEL * slo_ms.min()
    if tight.all():
        return none
    d = np.arange(1, max(s.d_max, 1) + 1)
    stretch = _iteration_cost(budget, n, int(tight.sum()), d, s, s.draft_cost_tokens) / (budget + n)
    tight_tpot = stretch / _chain_tokens(d, s)
    ok = (t_plain_ms * stretch <= s.slack_margin * slo_ms[~tight].min()) & (tight_tpot < 1.0)
    if not ok.any():
        return none
    return tight, int(d[ok][np.argmin(tight_tpot[ok])])


@dataclass(frozen=True)
class SLOFloor:
    """The best TPOT one request alone can expect from this deployment."""

    tpot_ms: float  # predicted iteration time / expected tokens per iteration
    depth: int  # the chain depth that gives it (0: plain decoding)


def slo_floor(t_plain_ms: float, budget: int, s: AdaptiveSettings, depth_max: int) -> SLOFloor:
    """min over d in [0, depth_max] of t(d) / sum(alpha^j, j = 0..d): a request alone,
    drafted d steps deep, waits t(d) = t_plain (B + 1 + d + d (c + c_n)) / (B + 1) per
    iteration (cost_depth's model: a verify of its root and d chain tokens plus d draft
    steps) and gets the bonus token plus each drafted token with probability alpha^j.

    No SLO below it can be expected to hold, even on an idle server. The old floor,
    t_plain / (d_max + 1), assumed every draft token accepted and every draft step free.
    Without a cost model (`draft_cost_tokens` None) draft steps count as free here too,
    so the floor stays a lower bound of what the engine plans. `depth_max` 0 (no
    drafter) gives t_plain."""
    d = np.arange(0, max(depth_max, 0) + 1)
    per_step = 0.0
    if s.draft_cost_tokens is not None:
        per_step = s.draft_cost_tokens + s.draft_cost_tokens_per_request
    iteration_ms = t_plain_ms * (budget + 1 + d * (1 + per_step)) / (budget + 1)
    tpot = iteration_ms / _chain_tokens(d, s)
    best = int(np.argmin(tpot))
    return SLOFloor(float(tpot[best]), int(d[best]))


def _clip(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


@dataclass
class AcceptanceEstimate:
    """Online estimate of alpha, the probability that the target accepts the next level
    of a drafted tree, as the cost model uses it.

    Each verification is a run of accepted levels that ends either in a rejection (the
    last accepted node had children and the target picked none of them) or at a leaf
    (censored: the tree simply ended there). The maximum-likelihood alpha of such runs is
    accepted / (accepted + rejections). The counts start as `weight` pseudo-observations
    of the prior, and every iteration (`tick`) fades the evidence back toward them: the
    estimate follows a changing workload, and a drafter that a bad stretch switched off
    (plain decoding: no more evidence) is tried again a few hundred iterations later."""

    prior: float
    weight: float = 5.0
    decay: float = 0.99  # per iteration: evidence counts for ~100 iterations
    accepted: float = field(init=False)
    rejected: float = field(init=False)

    def __post_init__(self) -> None:
        self.accepted = self.prior * self.weight
        self.rejected = (1.0 - self.prior) * self.weight

    def observe(self, accepted: int, rejected: bool) -> None:
        self.accepted += accepted
        self.rejected += float(rejected)

    def tick(self) -> None:
        d, w = self.decay, (1.0 - self.decay) * self.weight
        self.accepted = d * self.accepted + w * self.prior
        self.rejected = d * self.rejected + w * (1.0 - self.prior)

    @property
    def alpha(self) -> float:
        total = self.accepted + self.rejected
        return min(max(self.accepted / total, ALPHA_MIN), ALPHA_MAX) if total > 0 else ALPHA_MIN
