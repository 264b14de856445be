"""Steps 2 and 3 of the iteration, up to the forward: the proposals cut to the context
window, the selection of each request's tree within the budget (the scheduler:
Algorithm 2, or 1 under policy `optimal`), the branches a grammar rejects pruned, and
preemption until the forward's KV fits. What is left is the verify batch.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from adaserve import metrics
from adaserve.engine.contracts import Proposals, StepPlan, VerifyBatch
from adaserve.engine.lifecycle import guard, release_drafts
from adaserve.engine.planner import iteration_ms, progress_of
from adaserve.engine.state import Request
from adaserve.scheduler import selection_params
from adaserve.selection import RequestProgress, Selection, SelectionParams
from adaserve.target import LogitsContext, VerifyItem
from adaserve.tree import CandidateTree

if TYPE_CHECKING:
    from adaserve.engine.core import Engine

log = logging.getLogger("adaserve.engine")


def verify_batch(eng: Engine, plan: StepPlan, proposals: Proposals) -> VerifyBatch:
    """The forward's input: the trees cut to the window (before selection, so the
    budget goes to nodes the window can hold), selected, pruned by their grammars; the
    requests whose own work failed so far dropped, and the rest preempted as far as
    the KV needs."""
    trees = fit_context(eng, plan.decoding, proposals.trees)
    trees = select(eng, plan, trees)
    trees, logits = constrain(eng, plan.decoding, trees)
    plan, keep = plan.without(lambda r: r.finished)
    trees = [trees[i] for i in keep]
    sources = [proposals.sources[i] for i in keep]
    preempted = []
    while not fits(eng, plan, trees):
        victim = pick_victim(eng)
        preempt(eng, victim)
        preempted.append(victim.req.id)
        plan, keep = plan.without(lambda r, victim=victim: r is victim)
        trees = [trees[i] for i in keep]
        sources = [sources[i] for i in keep]
    eng.carrying = plan.carried
    items = [
        VerifyItem(
            r.req.id,
            tree,
            r.req.sampling,
            r.generator,
            r.req.sampling.max_tokens - r.num_generated,
            logits.get(r.req.id),
        )
        for r, tree in zip(plan.decoding, trees, strict=True)
    ]
    return VerifyBatch(plan, trees, sources, items, tuple(preempted))


def fit_context(
    eng: Engine, decoding: list[Request], trees: list[CandidateTree]
) -> list[CandidateTree]:
    """Each tree cut to the context window: its node at depth d would sit at position
    len(tokens) - 1 + d (an n-gram tree of a request near the end outgrows it)."""
    out = list(trees)
    for i, (r, tree) in enumerate(zip(decoding, trees, strict=True)):
        room = eng.max_model_len - len(r.tokens)
        if len(tree) > 1:
            with guard(eng, r, "tree"):
                depths = tree.depths()
                if int(depths.max()) > room:
                    out[i] = tree.subtree(np.nonzero(depths <= room)[0])
    return out


def select(eng: Engine, plan: StepPlan, trees: list[CandidateTree]) -> list[CandidateTree]:
    """Each request's selected subtree within the iteration's budget (the scheduler)."""
    if all(len(t) == 1 for t in trees):
        return trees
    n = len(trees)
    budget = max(plan.batch.tree_budget, n)  # every root must fit
    # The iteration's predicted latency: a decode step of the budget, plus what the
    # prefill chunks riding along add to the forward.
    prefill = plan.batch.prefill_tokens
    extra = 0.0
    if prefill:
        extra = iteration_ms(eng, budget, prefill) - iteration_ms(eng, budget, 0)
    t_spec_ms = eng.tspec.measured_ms(budget) + extra
    # A_cap = min(A, d + 1) with d the deepest tree (n-gram trees outgrow the plan).
    depth = max(plan.depth, max(int(t.depths().max()) for t in trees))
    params = selection_params(eng.settings.scheduler, depth, t_spec_ms, n, budget)
    progress = progress_of(eng, plan.decoding)
    selection = eng.scheduler.select(progress, trees, params)
    if selection.invalid:
        selection = _optimal_invalid(eng, progress, trees, params)
    return [t.subtree(idx) for t, idx in zip(trees, selection.selected, strict=True)]


def _optimal_invalid(
    eng: Engine,
    progress: list[RequestProgress],
    trees: list[CandidateTree],
    params: SelectionParams,
) -> Selection:
    """Policy optimal (Algorithm 1) found no allocation that meets every request's
    A(r) within the budget: this iteration selects with policy adaserve instead."""
    metrics.optimal_invalid_total.inc()
    if not eng.optimal_invalid_logged:
        eng.optimal_invalid_logged = True
        log.warning(
            "policy optimal: no allocation meets every SLO this iteration; selecting "
            "with policy adaserve where that happens (adaserve_selection_optimal_"
            "invalid_total counts them)"
        )
    return eng.local_scheduler.select(progress, trees, replace(params, policy="adaserve"))


def constrain(
    eng: Engine, decoding: list[Request], trees: list[CandidateTree]
) -> tuple[list[CandidateTree], dict[str, LogitsContext | None]]:
    """Structured output: each constrained tree without the branches its grammar
    rejects (they could never be accepted); and by request id what the target needs
    to process its rows (the grammar's mask at every node that is left included)."""
    logits: dict[str, LogitsContext | None] = {}
    out = list(trees)
    for i, r in enumerate(decoding):
        with guard(eng, r, "constrain"):
            masks = None
            if r.constraint is not None:
                out[i], masks = r.constraint.tree_masks(trees[i])
            logits[r.req.id] = r.logits_context(masks)
    return out, logits


def fits(eng: Engine, plan: StepPlan, trees: list[CandidateTree]) -> bool:
    """Whether the forward's new KV fits in the free blocks: the trees' scratch and
    the chunks' tokens."""
    growth = {r.req.id: len(t) for r, t in zip(plan.decoding, trees, strict=True)}
    for r, c in plan.chunks:
        growth[r.req.id] = growth.get(r.req.id, 0) + len(c.tokens)
    return eng.target.blocks_needed(growth) <= eng.target.free_blocks()


def pick_victim(eng: Engine) -> Request:
    """The running request preempted when KV runs out: the lowest priority, then the
    most slack against its SLO, whoever needs the blocks, so a relaxed request gives
    way to a tight one, never the reverse."""
    now = eng.clock()

    def slack_ms(r: Request) -> float:
        if r.num_generated == 0:  # not started: how long its first token may wait
            return (r.ttft_deadline - now) * 1000.0
        elapsed, decoded = r.elapsed_decoded(now)
        return r.req.tpot_slo_ms * (decoded + 1) - elapsed

    return max(eng.pool.running.values(), key=lambda r: (r.req.priority, slack_ms(r)))


def preempt(eng: Engine, r: Request) -> None:
    """Preemption by recompute: free the request's KV (its full blocks stay in the
    prefix cache, so coming back is cheap while they are not evicted) and queue it
    again; it keeps its tokens and its stream, and later recomputes the KV of all but
    its last token in chunks, that token rooting its next tree as before."""
    eng.target.free(r.req.id)
    release_drafts(eng, r)
    r.prefilled = 0
    r.prefill_target = len(r.tokens) - 1 if r.num_generated else r.num_prompt
    eng.preemptions += 1
    del eng.pool.running[r.req.id]
    eng.pool.waiting.append(r)
    metrics.preemptions_total.inc()
    log.debug("preempted %s (%d tokens) for KV", r.req.id, len(r.tokens))
