"""What one iteration runs, decided before any drafter is asked: which decoding requests
get a tree and how deep and wide (the plan's d and w, adaserve/adaptive.py), which
prompts get a prefill chunk of how many tokens, and the tree budget selection may spend
(the token split of adaserve/batching.py: SLO trees, prefill by TTFT deadline, then
throughput). No torch: the planner imports without it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from adaserve.adaptive import plan_depth_width, slack_plan
from adaserve.batching import (
    BatchLimits,
    BatchPlan,
    Prefilling,
    behind_tpot,
    form_batch,
    slo_tree_budget,
)
from adaserve.config import AdaptiveSettings
from adaserve.engine.contracts import StepPlan
from adaserve.engine.lifecycle import guard
from adaserve.engine.state import Request, draftable
from adaserve.methods import USES_NGRAM, chain_tokens
from adaserve.selection import RequestProgress
from adaserve.slo import required_accepted
from adaserve.target import PrefillChunk
from adaserve.tree import CandidateTree

if TYPE_CHECKING:
    from adaserve.engine.core import Engine


def form_step(eng: Engine) -> StepPlan:
    """The iteration's plan: the drafted requests and their depth and width, then the
    batch's token split and the prompt chunks it carries."""
    running = eligible(eng)
    decoding = [r for r in running if not r.prefilling]
    prefilling = [r for r in running if r.prefilling]
    drafted, depth, width = plan_drafts(eng, decoding, prefilling)
    sched = eng.settings.scheduler
    yields = sched.policy == "adaserve" and sched.yield_to_prefill
    split = _Split(eng, decoding, prefilling, yields)
    batch = split.plan(drafted, depth, width)
    if yields and drafted and batch.ttft_short:
        # Speculation yields to prefill: the deadlines need more than this iteration
        # carries, and its draft step is time the prompts lose. Draft only for those
        # plain decoding would leave behind their TPOT SLO (where none is, this is a
        # continuous-batching iteration); their SLO trees stay in the plan.
        behind = behind_without_drafts(eng, drafted, eng.tspec.predict_ms(len(decoding)))
        drafted = [r for r, b in zip(drafted, behind, strict=True) if b]
        if len(drafted) < len(behind):  # (at the planned depth: a smaller batch's deeper
            batch = split.plan(drafted, depth, width)  # plan would cost prefill more)
    if sched.policy == "adaserve" and drafted and batch.tree_budget <= len(decoding):
        # The split leaves the trees no token past their roots (a knee below the batch,
        # or prefill deadlines took the rest): no drafted token could be verified, and
        # the draft step would only lengthen the iteration. Plain decoding, planned as
        # such (the draft step's time goes to the prompts). Policy adaserve only: the
        # baselines draft as the systems they stand for do.
        drafted, depth, width = [], 0, 1
        batch = split.plan(drafted, depth, width)
    eng.ttft_short = batch.ttft_short
    eng.last_prefill_tokens = batch.prefill_tokens
    chunks = []
    for rid, n in batch.chunks:
        r = eng.pool.running[rid]
        chunk = _chunk(eng, r, n)
        if chunk is not None:
            chunks.append((r, chunk))
    return StepPlan(decoding, drafted, depth, width, chunks, batch)


def eligible(eng: Engine) -> list[Request]:
    """The running requests this iteration may carry: the quarantine's head group
    while it holds suspects (adaserve/isolation.py), else all."""
    running = eng.pool.running
    allowed = eng.quarantine.allowed(running.keys())
    return [r for r in running.values() if allowed is None or r.req.id in allowed]


class _Split:
    """The batch's token split (batching.form_batch) for a draft plan, over the
    requests' progress as of one instant."""

    def __init__(
        self, eng: Engine, decoding: list[Request], prefilling: list[Request], yields: bool
    ) -> None:
        self.eng, self.decoding, self.yields = eng, decoding, yields
        self.slo_prefill = slo_first(eng)
        self.adaptive = adaptive_settings(eng)
        self.now = eng.clock()
        self.progress = [r.decoding(self.now) for r in decoding]
        self.prompts = [
            Prefilling(
                r.req.id,
                r.prefill_target - r.prefilled,
                r.ttft_deadline * 1000.0,
                r.req.priority,
                r.arrival * 1000.0,
                r.prefilled,
                r.ttft_bound,
                r.num_generated > 0,
            )
            for r in prefilling
        ]

    def plan(self, drafted: list[Request], depth: int, width: int) -> BatchPlan:
        eng, decoding = self.eng, self.decoding
        settings = eng.settings.engine
        # The trees' size for the token split: the model's plan, else n-gram chains where
        # a request may get one (they cost no draft step, only verify tokens).
        tree_depth, tree_width = (depth, width) if drafted else (0, 1)
        if not drafted and eng.ngram and any(r.method in USES_NGRAM for r in decoding):
            tree_depth = eng.settings.speculation.ngram.depth
        limits = BatchLimits(
            tree_budget=tree_budget(eng, decoding, depth if drafted else 0, self.adaptive),
            max_batch_tokens=settings.max_batch_tokens,
            min_prefill_tokens=settings.min_prefill_tokens,
            stretch=settings.prefill_stretch,
            depth=tree_depth,
            width=tree_width,
            acceptance=self.adaptive.acceptance,
            yield_tokens=self.yields,
            slo_prefill=self.slo_prefill,
        )
        return form_batch(
            self.progress,
            self.prompts,
            limits,
            partial(iteration_ms, eng),
            eng.costs.draft_ms if drafted else 0.0,
            self.now * 1000.0,
            # What a decode-only iteration of this batch has taken, drafting and
            # selection included: the work a prefill chunk may stretch.
            eng.tspec.measured_ms(_decode_tokens(eng, decoding, tree_depth, tree_width)),
        )


def _chunk(eng: Engine, r: Request, n: int) -> PrefillChunk | None:
    """The request's next `n` prompt tokens as the forward takes them; None where
    building its logits processing failed (the request has ended)."""
    toks = np.asarray(r.tokens[r.prefilled : r.prefilled + n], dtype=np.int32)
    # The chunk that completes a prompt samples the first token; one that completes a
    # preempted request's recompute does not (its root is known).
    last = r.prefilled + n == r.prefill_target and r.num_generated == 0
    logits = None
    if last and r.req.sampling.processes_logits:
        with guard(eng, r, "prefill"):
            first_masks = None
            if r.constraint is not None:
                first_masks = r.constraint.tree_masks(CandidateTree.root_only(0))[1]
            logits = r.logits_context(first_masks)
        if r.finished:
            return None
    scored, k = None, 0
    if r.scores_prompt:
        if r.prefilled == 0:  # (again, after a preemption): from the start
            r.prompt_lp = []
        prompt = r.req.prompt_token_ids
        scored = np.asarray(
            prompt[r.prefilled + 1 : min(r.prefilled + n + 1, len(prompt))], dtype=np.int32
        )
        k = r.req.sampling.prompt_logprobs or 0
    sp = r.req.sampling
    return PrefillChunk(r.req.id, toks, r.prefilled, last, sp, r.generator, logits, scored, k)


def plan_drafts(
    eng: Engine, batch: list[Request], prefilling: list[Request]
) -> tuple[list[Request], int, int]:
    """(requests to draft for, depth, width). d and w are a pure function of n and
    the settings this process already holds: planning locally saves one of the three
    round trips of a gRPC iteration (the scheduler service keeps `Plan` for others)."""
    # Only requests whose method may use the model draft with it; the others still
    # count in the load the plan is for.
    now = eng.clock()
    for r in batch:
        # Behind its TPOT SLO so far (as the prompt hold judges it, after enough
        # tokens for that to mean something): a relaxed request is drafted for.
        r.needs_drafts = behind_tpot([r.decoding(now)])
    if eng.drafter is None or not any(draftable(eng, r) for r in batch):
        return [], 0, 1
    budget, adaptive = eng.settings.scheduler.budget, adaptive_settings(eng)
    # Plan for the batch the next iterations run: requests being prefilled and
    # those that arrived during this step join it soon. Otherwise the first request
    # of a burst drafts deep alone while the rest are prefilled. An abort queued
    # there counts too: an overestimate for one iteration at most.
    arriving = eng.pool.inbox.qsize()
    n = min(len(batch) + len(prefilling) + arriving, eng.settings.engine.max_running)
    riding = riding_prefill(eng, prefilling)
    # Policy adaserve: where the budget cannot give each decoding request a drafted
    # token, the depth counts the tokens it can (adaptive.budget_bound_depth).
    roots = len(batch) if eng.settings.scheduler.policy == "adaserve" else None
    depth, width = plan_depth_width(n, budget, adaptive, riding, roots)
    if depth > 0:
        # Policy adaserve: planned for the tree tokens the tightest SLO allows.
        slo_budget = tree_budget(eng, batch, depth, adaptive)
        if slo_budget > budget:
            depth, width = plan_depth_width(n, slo_budget, adaptive, riding, roots)
        return [r for r in batch if draftable(eng, r)], depth, width
    # Drafting for the whole batch does not pay, but SLO comes before throughput.
    # Requests that plain decoding would leave behind their SLO still get trees, and
    # so do the tightest-SLO requests where the others' slack pays for the longer
    # iteration (adaptive.slack_plan).
    t_plain = eng.tspec.predict_ms(len(batch))
    behind = behind_without_drafts(eng, batch, t_plain)
    tight, slack_depth = slack_plan(
        np.array([r.req.tpot_slo_ms for r in batch]), t_plain, budget, adaptive
    )
    drafted = [
        r for r, b, t in zip(batch, behind, tight, strict=True) if (b or t) and draftable(eng, r)
    ]
    if not drafted:
        return [], 0, width
    depth, width = plan_depth_width(len(drafted), budget, adaptive)
    return drafted, slack_depth or depth, width


def riding_prefill(eng: Engine, prefilling: list[Request]) -> int:
    """Prompt tokens the coming iteration should carry beside its decoders, as the depth's
    cost model counts them (adaptive.cost_depth; policy adaserve): the last
    iteration's, while running requests are still being prefilled and no TTFT SLO waits
    on one of them (a prompt still waiting for admission rides along in no chunk).
    There the chunk is a fixed cost the decoders wait for whatever their depth, and a
    deeper chain is what keeps their TPOT (the random sweep's CPU draws, where prompts
    rode along in most iterations and fixed chains of 1-3 beat adaserve on its tight
    class's TPOT: BENCHMARKS.md, "Prefill riding along"). Where a TTFT SLO waits, a
    longer iteration would be paid in prefill: 0, the plan without prefill.
    `prefilling`: the running requests whose prompts are being prefilled (form_step's)."""
    if eng.settings.scheduler.policy != "adaserve" or not prefilling:
        return 0
    return 0 if any(r.ttft_bound for r in prefilling) else eng.last_prefill_tokens


def slo_first(eng: Engine) -> bool:
    """Policy adaserve with `scheduler.slo_prefill`: the prompts an SLO waits on
    (`Request.slo_waits`) are prefilled, and admitted, before the others."""
    sched = eng.settings.scheduler
    return sched.policy == "adaserve" and sched.slo_prefill


def tree_budget(
    eng: Engine, decoding: list[Request], depth: int, adaptive: AdaptiveSettings
) -> int:
    """This iteration's tree budget: the knee B, or (policy adaserve with
    `slo_budget`) what the tightest decoding request's SLO lets the forward take."""
    sched = eng.settings.scheduler
    if sched.policy != "adaserve" or not sched.slo_budget or not decoding or depth <= 0:
        return sched.budget
    return slo_tree_budget(
        min(r.req.tpot_slo_ms for r in decoding),
        chain_tokens(adaptive.acceptance, depth),
        eng.costs.draft_ms,
        lambda t: eng.latency.predict_ms(t),
        sched.budget,
        eng.settings.engine.max_batch_tokens,
    )


def _decode_tokens(eng: Engine, decoding: list[Request], depth: int, width: int) -> int:
    """Tree tokens a decode-only iteration of this batch verifies at most."""
    n = len(decoding)
    return min(max(eng.settings.scheduler.budget, n), n * (1 + depth * width))


def iteration_ms(eng: Engine, tree_tokens: int, prefill_tokens: int, context: float = 0.0) -> float:
    """Predicted forward latency, plus the drafter's ingestion of the chunks."""
    return eng.latency.predict_ms(tree_tokens, prefill_tokens, context) + (
        prefill_tokens * eng.costs.ingest_ms
    )


def adaptive_settings(eng: Engine) -> AdaptiveSettings:
    """The depth/width settings, with the learned acceptance where it is learned."""
    adaptive = eng.settings.scheduler.adaptive
    if eng.acceptance is None:
        return adaptive
    return adaptive.model_copy(update={"acceptance": eng.acceptance.alpha})


def behind_without_drafts(eng: Engine, batch: list[Request], t_plain_ms: float) -> np.ndarray:
    """Which requests need more than the bonus token this iteration, A(r) > 1, if
    the iteration is a plain decoding step of the whole batch."""
    progress = progress_of(eng, batch)
    a = required_accepted(
        np.array([p.elapsed_ms for p in progress]),
        np.array([p.decoded for p in progress], dtype=np.float64),
        np.array([p.tpot_slo_ms for p in progress]),
        t_plain_ms,
    )
    return a > 1.0


def progress_of(eng: Engine, batch: list[Request]) -> list[RequestProgress]:
    """Each request's (SLO, l_r, o_r) as selection reads them."""
    now = eng.clock()
    return [RequestProgress(r.req.id, r.req.tpot_slo_ms, *r.elapsed_decoded(now)) for r in batch]
