"""Step 1 of the iteration: candidate trees for the decoding requests.

Each request's tree comes from the source its speculation method picks this iteration
(adaserve/methods.py): the draft model (or EAGLE head), the n-gram drafter, both merged,
or none (a root-only tree: plain decoding). The n-gram drafter goes first: it costs no
forward, and `auto` reads its trees to decide which requests the model drafts for. The
same calls hand each drafter this iteration's prompt chunks of the requests whose method
may use it, and the features an EAGLE head reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from adaserve.adaptive import ngram_pays as ngram_pays_at
from adaserve.drafter import DraftUpdate
from adaserve.engine.contracts import Proposals, StepPlan
from adaserve.engine.estimates import ALPHA
from adaserve.engine.lifecycle import guard
from adaserve.engine.planner import adaptive_settings
from adaserve.engine.state import Request, draftable
from adaserve.latency import ewma
from adaserve.methods import (
    USES_NGRAM,
    chain_tokens,
    choose_source,
    drafter_source,
    expected_tokens,
    scale_f,
    uses_drafter,
    uses_ngram,
)
from adaserve.target import ForwardResult, PrefillChunk
from adaserve.tree import CandidateTree, merge_trees

if TYPE_CHECKING:
    from adaserve.engine.core import Engine
    from adaserve.fallback import FallbackDrafter

# Decayed verifications of n-gram trees (SourceStats.steps) from which `auto` judges
# them by what they measured rather than by their prior acceptance.
NGRAM_EVIDENCE_STEPS = 5.0


def speculate(eng: Engine, plan: StepPlan) -> Proposals:
    """Trees for the plan's decoding requests, each from the source its method picks;
    root-only for the rest (a drafter catches up on their tokens the next time it
    sees them)."""
    roots = [CandidateTree.root_only(r.tokens[-1]) for r in plan.decoding]
    if eng.drafter is None and eng.ngram is None:
        return Proposals(roots, ["none"] * len(roots))
    ng = eng.settings.speculation.ngram
    # Where its trees do not pay, `auto` spends no lookups either (they are host
    # time every request waits for); the requests catch up on their next lookup.
    pays = eng.ngram is not None and ngram_pays(eng, len(plan.decoding))
    looked_up = [
        r for r in plan.decoding if r.method == "ngram" or (pays and r.method in USES_NGRAM)
    ]
    t0 = eng.clock()
    ngram = _draft(
        eng,
        eng.ngram,
        "ngram_len",
        looked_up,
        [(r, c) for r, c in plan.chunks if r.method in USES_NGRAM],
        ng.depth,
        ng.width,
        0.0,  # selection prunes its unlikely nodes; drafting them costs no forward
    )
    eng.costs.ngram_lookup_ms = (eng.clock() - t0) * 1000.0 if looked_up else 0.0
    calibration = eng.method_stats["ngram"].calibration
    ngram = {rid: scale_f(t, calibration) for rid, t in ngram.items()}
    sources = _choose_sources(eng, plan, ngram, pays)
    drafted = [r for r, s in zip(plan.decoding, sources, strict=True) if uses_drafter(s)]
    t0 = eng.clock() if drafted else 0.0
    model = _draft(
        eng,
        eng.drafter,
        "drafter_len",
        drafted,
        [(r, c) for r, c in plan.chunks if draftable(eng, r)],
        plan.depth,
        plan.width,
        eng.settings.scheduler.adaptive.draft_stop_prob or 0.0,
    )
    if drafted and model:  # what auto weighs against an n-gram tree alone
        ms = (eng.clock() - t0) * 1000.0
        eng.costs.model_draft_ms = ewma(eng.costs.model_draft_ms, ms, ALPHA)
    trees = list(roots)
    for i, (r, source) in enumerate(zip(plan.decoding, sources, strict=True)):
        rid = r.req.id
        with guard(eng, r, "tree"):
            if uses_drafter(source) and uses_ngram(source):
                trees[i] = merge_trees(model.get(rid, roots[i]), ngram.get(rid, roots[i]))
            elif source != "none":
                trees[i] = (ngram if source == "ngram" else model).get(rid, roots[i])
    return Proposals(trees, sources)


def _choose_sources(
    eng: Engine, plan: StepPlan, ngram: dict[str, CandidateTree], pays: bool
) -> list[str]:
    """Per decoding request, what drafts its tree (methods.choose_source)."""
    planned = {r.req.id for r in plan.drafted} if plan.depth > 0 else set()
    model_tokens = chain_tokens(adaptive_settings(eng).acceptance, plan.depth)
    share = eng.costs.model_draft_ms / max(eng.tspec.predict_ms(len(plan.decoding)), 1e-6)
    sources = []
    for r in plan.decoding:
        source = choose_source(
            r.method,
            r.req.id in planned,
            expected_tokens(ngram.get(r.req.id)),
            model_tokens,
            share,
            eng.drafter is not None,
            eng.ngram is not None,
            pays,
        )
        sources.append(drafter_source(source, eng.drafter_kind))
    return sources


def ngram_pays(eng: Engine, n: int) -> bool:
    """Whether verifying n-gram trees pays for a batch of n (adaptive.ngram_pays):
    with what its trees measured per verification (tokens emitted, draft tokens
    verified: decayed counts, SourceStats), or while that evidence is thin (at
    first, and again once it has faded after the trees stopped paying, which so
    tries them again) chains at its learned per-level acceptance; and its measured
    host time per request in token-units of this batch's iteration."""
    budget = eng.settings.scheduler.budget
    unit_ms = eng.tspec.measured_ms(n) / (budget + n)
    host = eng.costs.ngram_host_ms / max(unit_ms, 1e-6)
    seen = eng.method_stats["ngram"]
    if seen.steps >= NGRAM_EVIDENCE_STEPS:
        return ngram_pays_at(n, budget, seen.tokens_per_step, seen.drafted / seen.steps, host)
    depth = np.arange(1, max(eng.settings.speculation.ngram.depth, 1) + 1)
    chains = [chain_tokens(eng.ngram_acceptance.alpha, int(d)) for d in depth]
    return ngram_pays_at(n, budget, np.array(chains), depth, host)


def _draft(
    eng: Engine,
    drafter: FallbackDrafter | None,
    synced: Literal["drafter_len", "ngram_len"],
    requests: list[Request],
    chunks: list[tuple[Request, PrefillChunk]],
    depth: int,
    width: int,
    stop_prob: float,
) -> dict[str, CandidateTree]:
    """One drafter's trees for `requests` (by id; none where it failed), sending
    each the tokens it does not hold yet (`synced` names the request's count of
    them) and ingesting the prompt `chunks`."""
    if drafter is None:
        return {}
    if drafter is eng.drafter and eng.feature_dim:
        updates = _eagle_updates(eng, requests, chunks)
    else:
        updates = [
            DraftUpdate(
                r.req.id,
                np.asarray(r.tokens[getattr(r, synced) :], np.int32),
                len(r.tokens) - _start(r, synced),
            )
            for r in requests
        ]
        for r, c in chunks:
            end = c.start + len(c.tokens)
            if end <= _start(r, synced):
                continue  # a chunk before the drafter's window
            new = np.asarray(r.tokens[getattr(r, synced) : end], np.int32)
            updates.append(DraftUpdate(r.req.id, new, end - _start(r, synced), ingest=True))
    if not updates:
        return {}
    trees = drafter.speculate(updates, depth, width, stop_prob)
    if not drafter.ok:
        return {}
    lost = set(drafter.lost)
    for u in updates:
        if u.id in lost:
            continue
        r = eng.pool.running[u.id]
        setattr(r, synced, u.total_len + _start(r, synced))
        if u.hidden is not None and r.feats is not None:
            r.feats.drop_before(u.total_len - 1)  # the next token's row stays
    eng.recompute |= lost
    return {
        u.id: t for u, t in zip(updates, trees, strict=True) if not u.ingest and u.id not in lost
    }


def _start(r: Request, synced: str) -> int:
    """Where the drafter named by `synced` starts reading the request's tokens: the
    lengths it is sent count from there (draft_start, 0 for an EAGLE head; the n-gram
    drafter reads every token)."""
    return r.draft_start if synced == "drafter_len" else 0


def _eagle_updates(
    eng: Engine, requests: list[Request], chunks: list[tuple[Request, PrefillChunk]]
) -> list[DraftUpdate]:
    """Updates for an EAGLE drafter: each request's tokens from what the drafter
    holds up to the last one whose preceding position's features the target has
    computed, with those rows. A decoding request's chain must reach its root;
    where it cannot (its features are gone), it gets none and its features are
    recomputed (`recovery.recompute_features`). Prompt chunks go in one iteration
    late: the features a chunk's tokens need come from the forward that prefills it."""
    updates = []
    for r in requests:
        rows = None if r.feats is None else r.feats.window(r.drafter_len - 1, len(r.tokens) - 1)
        if rows is None:
            eng.recompute.add(r.req.id)
            continue
        new = np.asarray(r.tokens[r.drafter_len :], np.int32)
        updates.append(DraftUpdate(r.req.id, new, len(r.tokens), hidden=rows))
    for r, _ in chunks:
        if r.feats is None:
            continue
        end = min(r.feats.hi + 1, len(r.tokens))
        rows = r.feats.window(r.drafter_len - 1, end - 1)
        if end <= r.drafter_len or rows is None:
            continue
        new = np.asarray(r.tokens[r.drafter_len : end], np.int32)
        updates.append(DraftUpdate(r.req.id, new, end, ingest=True, hidden=rows))
    return updates


def keep_features(plan: StepPlan, result: ForwardResult) -> None:
    """The features the forward computed, kept for the requests an EAGLE drafter
    drafts: a tree's root and accepted path are the rows its new tokens need (the
    root's own position first), a chunk's rows those of its tokens."""
    if result.tree_features is not None:
        for r, rows in zip(plan.decoding, result.tree_features, strict=True):
            if r.feats is not None:
                r.feats.add(len(r.tokens) - 1, rows)
    if result.chunk_features is not None:
        for (r, c), rows in zip(plan.chunks, result.chunk_features, strict=True):
            if r.feats is not None:
                r.feats.add(c.start, rows)
