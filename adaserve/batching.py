"""Batch formation: what one iteration's forward carries (torch-free, no clock reads).

Every iteration runs one target forward holding the selected trees of the decoding
requests and prefill chunks of the prompts still being prefilled (SLOs-Serve's
`BatchForward`, paper 004; vLLM V1 and SGLang mix prefill and decode the same way).
`form_batch` decides the split, in SLO order:

1. **SLO trees.** Every decoding request gets its root, and a request behind schedule
   the drafted nodes it needs to get back on its TPOT SLO: A(r) > 1 tokens accepted
   this iteration take the shortest chain whose expected accepted tokens reach A_cap(r)
   (`adaserve/slo.py` has A(r); selection spends these first).
2. **Prefill the TTFT deadlines need.** Prompts are served earliest TTFT deadline first
   (policy adaserve: every prompt with a TTFT SLO before those without one); the tokens
   this iteration must prefill so that, at this pace, every prompt meets its deadline
   come next, taken from the throughput trees if need be.
3. **Throughput trees**, up to the knee budget B, as a decode-only iteration has.
4. **The rest of the time to prefill.** An iteration may run longer than its decode
   work by at most `stretch` times that work: a prompt that arrives slows the running
   streams by at most that factor. When the TTFT deadlines need more than the stretch
   leaves, the iteration may run longer, up to what keeps every decoding request on its
   TPOT SLO (a request ahead of its SLO has slack to spend). Policy adaserve
   (`slo_prefill`): the prompts without a TTFT SLO get only the decoders' slack, the
   longest iteration after which each is still on its TPOT SLO at the tokens its tree
   is expected to give; no SLO waits on their first token.

For prompts with a TTFT SLO the stretch is not capped by the TPOT SLOs. A TPOT SLO is
an average over the whole output, and the prefill work is the same whether it runs now
or later: deferring it to keep this iteration within every request's slack only delays
it into the same requests' later iterations, while the prompts wait and miss their
TTFT. Capping it did exactly that in the simulator (BENCHMARKS.md, "Unified
iteration"). A prompt without a TTFT SLO has no first token to miss: deferring its
prefill to where the decoders have slack (or none are left) costs no SLO, and on the
random sweep it is what lets speculation keep tight TPOT SLOs beside long prompts
(BENCHMARKS.md, "Random workloads").

The token counts come from the forward's latency model (`adaserve/latency.py`), not a
fixed chunk size. While prompts wait, each iteration prefills at least
`min_prefill_tokens`, so a steady stream of tight requests slows prefill down but never
stops it; earliest-deadline order then serves every prompt, since deadlines are finite
(a request without a TTFT SLO is ordered by a late default deadline).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from adaserve.methods import chain_tokens
from adaserve.slo import required_accepted


@dataclass(frozen=True)
class Decoding:
    """A request past its prefill: it roots a tree this iteration."""

    id: str
    tpot_slo_ms: float
    elapsed_ms: float  # l_r: since its first token
    decoded: int  # o_r: tokens decoded since the first
    # Its SLO was judged unattainable at submit (served best-effort): no slack to keep.
    best_effort: bool = False


@dataclass(frozen=True)
class Prefilling:
    """A request whose prompt is not all in the target's KV yet."""

    id: str
    remaining: int  # prompt tokens still to prefill, > 0
    deadline_ms: float  # its TTFT deadline on the engine clock; the prefill order
    priority: int = 0  # vLLM-style: lower first among equal deadlines
    arrival_ms: float = 0.0
    done: int = 0  # prompt tokens already prefilled: where its next chunk starts
    # The deadline is a TTFT SLO (False: a default that only orders the queue, so the
    # request is served eventually; it never makes an iteration longer).
    binding: bool = True
    # A preempted request recomputing its prompt: no TTFT deadline, but its TPOT SLO,
    # counted from a first token it already has, waits on this prefill.
    resumed: bool = False

    @property
    def waited_on(self) -> bool:
        """An SLO waits on this prompt's prefill (`slo_prefill` serves these first)."""
        return self.binding or self.resumed


@dataclass(frozen=True)
class BatchLimits:
    tree_budget: int  # B: the most tree tokens selection may verify (the verify knee)
    max_batch_tokens: int  # the most tokens one forward carries, trees and chunks
    min_prefill_tokens: int  # prefill progress per iteration while prompts wait
    stretch: float = 2.0  # the most an iteration may outlast its decode work, as a factor
    depth: int = 0  # planned draft depth this iteration (0: no drafting)
    width: int = 1
    acceptance: float = 0.75  # per drafted token: expected tokens per tree
    # Policy adaserve (`scheduler.yield_to_prefill`): when TTFT deadlines are at risk the
    # throughput trees give up tokens of the forward's cap as well as time. Without it
    # a large tree budget (the SLO-sized one) can fill max_batch_tokens and leave the
    # prompts min_prefill_tokens however late they are.
    yield_tokens: bool = False
    # Policy adaserve (`scheduler.slo_prefill`): the prompts with a TTFT SLO are
    # prefilled first, and the others only in the decoding requests' TPOT slack (step 4).
    slo_prefill: bool = False


@dataclass(frozen=True)
class BatchPlan:
    chunks: tuple[tuple[str, int], ...]  # (request id, prompt tokens) in deadline order
    tree_budget: int  # tokens selection may spend on trees (>= one root per request)
    slo_tree_tokens: int  # tree tokens reserved for the decoding requests' SLOs
    time_limit_ms: float  # the iteration time planned (inf: nothing decoding)
    prefill_context: float = 0.0  # chunk_context of the chunks
    # The prompts' TTFT deadlines needed more prefill than this iteration carries: what
    # the engine reads to let speculation yield (`scheduler.yield_to_prefill`).
    ttft_short: bool = False

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


# ms of one forward over (tree tokens, prefill tokens, prefill context): the latency
# model's prediction. The context is what the chunks' attention adds for starting deep
# in their prompts (`chunk_context`).
ForwardCost = Callable[[int, int, float], float]


def form_batch(
    decoding: Sequence[Decoding],
    prefilling: Sequence[Prefilling],
    limits: BatchLimits,
    forward_ms: ForwardCost,
    overhead_ms: float = 0.0,
    now_ms: float = 0.0,
    decode_ms: float | None = None,
) -> BatchPlan:
    """The iteration's split of tokens. `overhead_ms`: the iteration's time outside the
    forward (drafting); `now_ms`: the engine clock, on which deadlines are given;
    `decode_ms`: how long a decode-only iteration of this batch takes, as measured
    (None: the forward's prediction plus the overhead)."""
    n = len(decoding)
    slo_tokens = n + int(slo_draft_tokens(decoding, limits).sum())
    # Trees as large as the plan lets them be, up to the knee: a decode-only iteration.
    trees = n * (1 + limits.depth * limits.width) if limits.depth > 0 else n
    trees = max(min(trees, limits.tree_budget), slo_tokens)
    remaining = sum(p.remaining for p in prefilling)
    if remaining == 0:
        # Selection keeps the whole knee budget: its own SLO and marginal-value rules
        # decide what to verify, exactly as without prefill.
        return BatchPlan((), max(limits.tree_budget, n), slo_tokens, math.inf)
    cap = limits.max_batch_tokens
    order = prefill_order(prefilling, limits.slo_prefill)
    if n == 0:
        tokens = min(cap, remaining)
        if limits.slo_prefill:
            order = _prefill_only_order(prefilling, order, forward_ms, tokens, now_ms)
        chunks = _chunks(order, tokens)
        return BatchPlan(chunks, n, 0, math.inf, chunk_context(chunks, order))

    predicted = forward_ms(trees, 0, 0.0)
    decode_ms = max(decode_ms or 0.0, predicted + overhead_ms)
    overhead_ms = decode_ms - predicted  # all of the iteration outside the forward

    def with_prefill(t: int, p: int) -> float:
        return forward_ms(t, p, chunk_context(_chunks(order, p), order))

    # What smoothness prefers (the stretch), and how far TTFT deadlines may push past it.
    limit_ms = limits.stretch * decode_ms
    slo_ms = max(decode_ms, _slo_limit_ms(decoding, limits, decode_ms))

    def most_prefill(t: int, limit: float) -> int:
        return _most(lambda p: with_prefill(t, p), limit - overhead_ms, max(cap - t, 0))

    # Under `slo_prefill`, the prompts an SLO waits on (first in the order: those with a
    # TTFT SLO, and preempted requests' recomputes) take the stretch; the tokens past
    # them wait on no SLO, and take only the time every decoding request can spare.
    slack_ms, waited_on = limit_ms, remaining
    if limits.slo_prefill:
        waited_on = sum(p.remaining for p in order if p.waited_on)
        if waited_on < remaining:  # (the slack caps only prompts no SLO waits on)
            slack_ms = min(limit_ms, _slack_ms(decoding, limits, decode_ms))

    def fill(t: int) -> int:
        full = most_prefill(t, limit_ms)
        if full <= waited_on or slack_ms >= limit_ms:
            return full  # (without slo_prefill, always: one search, as before)
        return max(most_prefill(t, slack_ms), waited_on)

    prefill = fill(trees)
    need = _ttft_need(order, limit_ms, now_ms)
    if need > prefill and trees > slo_tokens:
        # Deadlines at risk: the throughput trees give way first (the SLO trees stay)...
        fit = _most(lambda t: with_prefill(t, need), limit_ms - overhead_ms, trees)
        if limits.yield_tokens:
            fit = min(fit, max(cap - need, 0))
        trees = max(slo_tokens, min(trees, fit))
        prefill = fill(trees)
    if need > prefill and slo_ms > limit_ms:
        # ... then smoothness: the iteration may outlast the stretch, not the slack.
        prefill = max(prefill, min(need, most_prefill(trees, slo_ms)))
        limit_ms = max(limit_ms, with_prefill(trees, prefill) + overhead_ms)
    short = need > prefill
    prefill = min(max(prefill, limits.min_prefill_tokens), remaining)
    chunks = _chunks(order, prefill)
    return BatchPlan(
        chunks, trees, slo_tokens, limit_ms, chunk_context(chunks, order), ttft_short=short
    )


def prefill_order(prefilling: Sequence[Prefilling], ttft_first: bool) -> list[Prefilling]:
    """The prompts in the order their chunks are served: earliest deadline first (a
    prompt without a TTFT SLO by its late default one), ties by priority, then arrival.
    `ttft_first` (policy adaserve, `slo_prefill`): every prompt an SLO waits on (a TTFT
    SLO, or a preempted request's TPOT) before those whose deadline only orders the
    queue. Otherwise a prompt without one, once its default deadline comes, goes ahead of
    later prompts with a TTFT SLO and makes them miss it for a first token no SLO waits
    on."""
    return sorted(
        prefilling,
        key=lambda p: (
            ttft_first and not p.waited_on,
            p.deadline_ms,
            p.priority,
            p.arrival_ms,
            p.id,
        ),
    )


# How much faster than the coming iteration's the prefill may be assumed to go when a
# prompt without a TTFT SLO is served ahead of one with it (`_prefill_only_order`): at
# half that pace the deadlines must still hold.
DEADLINE_ORDER_MARGIN = 2.0


def _prefill_only_order(
    prefilling: Sequence[Prefilling],
    slo_order: list[Prefilling],
    forward_ms: ForwardCost,
    tokens: int,
    now_ms: float,
) -> list[Prefilling]:
    """The prompts' order for an iteration that no request decodes in, under
    `slo_prefill`: earliest deadline first (a prompt without a TTFT SLO by its default
    one, as continuous batching orders them) wherever that order still meets every TTFT
    deadline at half this iteration's pace, else `slo_order` (those with a TTFT SLO
    first). With no decoder, the stretch and the slack do not apply: every prompt
    takes the whole chunk, and the order alone decides who waits. Put first whatever
    its deadline, a 6.5k-token prompt due in 26 s held the short prompts behind it
    for 5-7 s, at ~0.45 s a chunk. They then started decoding together and missed
    their TPOT (the random sweep's seed 2 draw 7 and seed 0 draw 19 on the CPU
    profile; BENCHMARKS.md, "Prompts in deadline order where no request decodes").
    Preempted requests' recomputes stay ahead of the rest: their TPOT SLO waits on
    them, and the check counts no deadline of theirs."""
    binding = [p.binding for p in prefilling]
    if all(binding) or not any(binding):
        return slo_order  # the same order either way: nothing to check
    edf = sorted(prefill_order(prefilling, False), key=lambda p: not p.resumed)  # (stable)
    pace_ms = forward_ms(0, tokens, chunk_context(_chunks(edf, tokens), edf))
    if _ttft_need(edf, pace_ms * DEADLINE_ORDER_MARGIN, now_ms) <= tokens:
        return edf
    return slo_order


def slo_tree_budget(
    tightest_slo_ms: float,
    expected_tokens: float,
    overhead_ms: float,
    decode_ms: Callable[[int], float],
    knee: int,
    cap: int,
) -> int:
    """The tree budget of an iteration whose tightest decoding request has TPOT SLO t:
    the most tree tokens N (at least the knee B, at most `cap`) whose decode iteration,
    decode_ms(N) + `overhead_ms` (drafting), still lets a request that gets
    `expected_tokens` per iteration keep pace: decode_ms(N) + overhead <= t * E.

    The knee B is where verify time starts to grow with the tokens, not a limit of what
    the SLOs allow: past it a node still costs little next to the iteration's fixed
    cost, and while the tightest request keeps its pace every other one does too."""
    limit = tightest_slo_ms * expected_tokens - overhead_ms
    return max(knee, _most(decode_ms, limit, cap))


# Policy adaserve's prompt hold (`scheduler.hold_prompts`): a prompt with a TTFT SLO
# waits while a decoding request is behind its TPOT SLO, until its deadline is this
# close (s) plus HOLD_PREFILL_FACTOR times what prefilling it and the prompts due before
# it takes at the full-batch rate (a prefill shares its iterations with the decoders).
HOLD_MARGIN_S = 0.5
HOLD_PREFILL_FACTOR = 3.0
HOLD_MIN_DECODED = 8  # a decoder's TPOT so far means little before this many tokens


def behind_tpot(progress: Sequence[Decoding]) -> bool:
    """Whether a decoding request's TPOT so far is above its SLO, l_r > t_r o_r (what
    attainment will say of it if nothing changes), among those with at least
    HOLD_MIN_DECODED tokens."""
    return any(
        d.decoded >= HOLD_MIN_DECODED and d.elapsed_ms > d.tpot_slo_ms * d.decoded for d in progress
    )


def hold_prompt(deadline_s: float, now_s: float, queue_tokens: int, ms_per_token: float) -> bool:
    """Whether a prompt with a TTFT deadline may wait this iteration, while decoders are
    behind their TPOT SLO: its deadline is further than HOLD_MARGIN_S plus
    HOLD_PREFILL_FACTOR times the prefill of `queue_tokens` (it and the prompts due
    before it) away. A prompt waiting is not yet in the batch: every decoding request
    then runs its iterations without that prompt's chunks and, once it decodes, its
    tree; the prompt's TTFT slack pays for it, not its TPOT (counted from its first
    token)."""
    need_s = HOLD_PREFILL_FACTOR * queue_tokens * ms_per_token / 1000.0
    return deadline_s - now_s > HOLD_MARGIN_S + need_s


def _slo_limit_ms(decoding: Sequence[Decoding], limits: BatchLimits, decode_ms: float) -> float:
    """The longest iteration that keeps every decoding request on its TPOT SLO: request
    r, l_r ms and o_r tokens past its first, is still on schedule after an iteration of
    T ms that gives it X tokens when (l_r + T) / (o_r + X) <= t_r, so T <= t_r (o_r +
    X) - l_r; a request ahead of its SLO has the slack to wait longer.

    X is the one token every iteration gives (the bonus) where that is enough: a
    prompt's stretch then never bets a request's SLO on its tree being accepted. Were X
    the expected E, every iteration under TTFT pressure would end with such requests on
    their SLO only on average, and their TPOT would be a coin toss where continuous
    batching's is certain. Requests that need more than the bonus to keep pace count at
    E (their trees are their chance); those that no iteration of the decode work's length
    keeps on schedule are left out (they need more tokens, not less prefill: selection's
    SLO phase is for them)."""
    certain = _pace_ms(decoding, 1.0)
    expected = _pace_ms(decoding, chain_tokens(limits.acceptance, limits.depth))
    t = np.where(certain >= decode_ms, certain, expected)
    saveable = t[t >= decode_ms]
    return float(saveable.min()) if saveable.size else decode_ms


def _slack_ms(decoding: Sequence[Decoding], limits: BatchLimits, decode_ms: float) -> float:
    """The longest iteration after which every decoding request is still on its TPOT
    SLO, min over r of t_r (o_r + E) - l_r with E the tokens its tree is expected to
    give, and at least the decode work: a request behind leaves no slack (its SLO is an
    average over its output; only faster iterations bring it back). At E, not at the
    bonus token alone as a deadline's stretch counts (`_slo_limit_ms`): this time buys
    no SLO, so it may not take what the trees are expected to earn, but it need not
    leave more: at 1, prompts without a TTFT SLO waited behind decoders that were on
    their SLO anyway, and the batch shrank (the random sweep's 59 req/s seed 0 draw 18:
    the same attainment at 0.76x the goodput). Best-effort requests are left out, as
    the prompt hold leaves them out: one is always behind, and would hold every prompt
    without a TTFT SLO to `min_prefill_tokens` while it decodes."""
    kept = [d for d in decoding if not d.best_effort]
    if not kept:
        return math.inf
    pace = _pace_ms(kept, chain_tokens(limits.acceptance, limits.depth))
    return max(decode_ms, float(pace.min()))


def _pace_ms(decoding: Sequence[Decoding], tokens: float) -> np.ndarray:
    """Per request, the longest iteration after which it is still on its TPOT SLO if
    the iteration gives it `tokens`: t_r (o_r + tokens) - l_r. float64 [n]."""
    slo = np.array([d.tpot_slo_ms for d in decoding])
    decoded = np.array([d.decoded for d in decoding], dtype=np.float64)
    elapsed = np.array([d.elapsed_ms for d in decoding])
    return slo * (decoded + tokens) - elapsed


def slo_draft_tokens(decoding: Sequence[Decoding], limits: BatchLimits) -> np.ndarray:
    """Drafted nodes each request needs this iteration to stay on its TPOT SLO: the
    shortest chain whose expected accepted tokens, sum(alpha^j, j = 0..k), reach
    A_cap(r) = min(A(r), d + 1), with A(r) at an iteration as long as the tightest SLO.
    int64 [n]; zeros without drafting."""
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


def _ttft_need(order: Sequence[Prefilling], iteration_ms: float, now_ms: float) -> int:
    """Prompt tokens this iteration must prefill for every prompt with a TTFT SLO to
    reach its deadline at this pace, prompts served in `order`: the largest, over the
    order's prefixes ending at such a prompt, of the prefix's remaining tokens spread
    over the whole iterations that end before its deadline (all of them once fewer than
    two do). Whole: the first token comes at the end of the iteration that completes
    the prompt, so 5.6 iterations' time is 5 iterations of prefill, and spreading over
    5.6 missed such deadlines by a fraction of an iteration."""
    need, total = 0.0, 0
    for p in order:
        total += p.remaining
        if not p.binding:
            continue
        iterations = math.floor((p.deadline_ms - now_ms) / iteration_ms)
        need = max(need, total / iterations if iterations > 1 else total)
    return math.ceil(need)


def chunk_context(chunks: Sequence[tuple[str, int]], prompts: Sequence[Prefilling]) -> float:
    """Thousands of (query, earlier prompt token) pairs the chunks' attention adds over
    the same chunks at their prompts' start: a chunk of k tokens starting at s attends
    k * s more keys (the latency curve, measured at a sequence's start, holds the rest)."""
    start = {p.id: p.done for p in prompts}
    return sum(k * start[rid] for rid, k in chunks) / 1000.0


def _most(cost: Callable[[int], float], limit_ms: float, cap: int) -> int:
    """The largest x in [0, cap] with cost(x) <= limit_ms (cost monotone), 0 if none."""
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= limit_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _chunks(order: Sequence[Prefilling], tokens: int) -> tuple[tuple[str, int], ...]:
    """`tokens` prompt tokens handed out in `order`, each prompt up to what it has left."""
    out = []
    for p in order:
        if tokens <= 0:
            break
        take = min(p.remaining, tokens)
        out.append((p.id, take))
        tokens -= take
    return tuple(out)
