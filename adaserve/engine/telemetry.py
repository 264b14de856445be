"""What each iteration teaches the engine's estimates (the forward latency model, the
decode iteration's time, the drafters' costs, the acceptance rates `auto` and the plan
read) and what it reports (the Prometheus metrics of adaserve/metrics.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from adaserve import metrics
from adaserve.engine.contracts import IterationTiming, VerifyBatch
from adaserve.engine.estimates import ALPHA
from adaserve.engine.state import Request, draftable
from adaserve.latency import ewma
from adaserve.methods import uses_drafter, uses_ngram
from adaserve.routing import UnitLoad
from adaserve.tree import CandidateTree

if TYPE_CHECKING:
    from adaserve.engine.core import Engine


def observe_iteration(eng: Engine, batch: VerifyBatch, timing: IterationTiming) -> None:
    """Learns from the iteration's times and reports them; last in the step, so the host
    time it reports covers everything outside the model phases (intake, admission,
    stop checks, detokenizing, streaming)."""
    if learn(eng, batch, timing):
        _report(eng, batch, timing)
        host = eng.clock() - timing.start - (timing.verified - timing.planned)
        metrics.iteration_seconds.labels("host").observe(max(host, 0.0))


def learn(eng: Engine, batch: VerifyBatch, timing: IterationTiming) -> bool:
    """Updates the estimates; False for a forward of prompt chunks alone (no decode
    iteration to learn from or report beyond its prefill)."""
    plan, costs = batch.plan, eng.costs
    tokens = sum(len(t) for t in batch.trees)
    prefill = plan.batch.prefill_tokens
    verify_ms = (timing.verified - timing.prepared) * 1000.0
    eng.latency.observe(tokens, prefill, plan.batch.prefill_context, verify_ms)
    speculate_ms = (timing.drafted - timing.planned) * 1000.0
    drafting = plan.depth > 0 and bool(plan.drafted)
    if prefill and eng.drafter is not None and eng.drafter.ok:
        ingest_ms = max(speculate_ms - (costs.draft_ms if drafting else 0.0), 0.0)
        costs.ingest_ms = ewma(costs.ingest_ms, ingest_ms / prefill, ALPHA)
        # The drafter ingests the chunks of the requests it drafts for, not the plain
        # ones (admission.relaxed), nor a chunk's tokens before the request's
        # draft_start: its cost per token it actually ingested.
        ingested = sum(
            min(len(c.tokens), c.start + len(c.tokens) - r.draft_start)
            for r, c in plan.chunks
            if draftable(eng, r) and c.start + len(c.tokens) > r.draft_start
        )
        if ingested:
            per_token = ingest_ms / ingested
            costs.drafter_ingest_ms = (
                ewma(costs.drafter_ingest_ms, per_token, ALPHA)
                if costs.drafter_ingest_ms
                else per_token
            )
    elif drafting:
        costs.draft_ms = ewma(costs.draft_ms, speculate_ms, ALPHA)
    if prefill:
        metrics.prefill_tokens_total.inc(prefill)
    if not plan.decoding:  # a forward of prompt chunks alone
        metrics.iteration_seconds.labels("prefill").observe(timing.verified - timing.prepared)
        return False
    if any(uses_ngram(s) for s in batch.sources):
        select_ms = (timing.prepared - timing.drafted) * 1000.0
        host = (costs.ngram_lookup_ms + select_ms) / len(plan.decoding)
        costs.ngram_host_ms = ewma(costs.ngram_host_ms, host, ALPHA)
    eng.iterations += 1
    if not prefill:  # t_spec predicts decode iterations
        eng.tspec.observe(tokens, (timing.verified - timing.planned) * 1000.0)
    if eng.acceptance is not None:
        eng.acceptance.tick()
    eng.ngram_acceptance.tick()
    for est in eng.method_stats.values():
        est.tick()
    return True


def _report(eng: Engine, batch: VerifyBatch, t: IterationTiming) -> None:
    metrics.iterations_total.inc()
    metrics.iteration_seconds.labels("speculate").observe(t.drafted - t.planned)
    metrics.iteration_seconds.labels("select").observe(t.prepared - t.drafted)
    metrics.iteration_seconds.labels("verify").observe(t.verified - t.prepared)
    metrics.iteration_seconds.labels("total").observe(t.verified - t.planned)
    metrics.budget_used.observe(sum(len(tree) for tree in batch.trees))
    for source, est in eng.method_stats.items():
        metrics.spec_method_tokens_per_step.labels(source).set(est.tokens_per_step)
        metrics.spec_method_acceptance.labels(source).set(est.acceptance)
    metrics.batch_size.observe(len(batch.plan.decoding))
    metrics.kv_usage.set(eng.target.kv_usage())


def record_spec(
    eng: Engine, source: str, tree: CandidateTree, accepted_nodes: np.ndarray, emitted: int
) -> None:
    """One verified tree: the speculative-decoding counters, and what the acceptance
    estimates learn from it."""
    drafted = len(tree) - 1
    accepted = len(accepted_nodes) - 1
    _record_method(eng, source, tree, drafted, accepted, emitted)
    if drafted == 0:
        return
    metrics.spec_num_drafts.inc()
    metrics.spec_emitted_tokens.inc(emitted)
    metrics.spec_num_draft_tokens.inc(drafted)
    metrics.spec_num_accepted_tokens.inc(accepted)
    for pos in range(accepted):
        metrics.spec_accepted_per_pos.labels(str(pos)).inc()
    # The run of accepted levels ended in a rejection if the last accepted node had
    # children to choose from; at a leaf the tree just ended (censored).
    rejected = bool((tree.parents == accepted_nodes[-1]).any())
    if source == "ngram":
        eng.ngram_acceptance.observe(accepted, rejected)
    if eng.acceptance is not None and uses_drafter(source):
        # The plan's acceptance is the model's: the n-gram drafter's trees, free to
        # draft, say nothing about whether its draft steps pay.
        eng.acceptance.observe(accepted, rejected)
        metrics.spec_acceptance_estimate.set(eng.acceptance.alpha)


def _record_method(
    eng: Engine, source: str, tree: CandidateTree, drafted: int, accepted: int, emitted: int
) -> None:
    """Per-method counts (metrics) and the learned estimates `auto` reads. The
    n-gram calibration compares accepted tokens with the f it predicted before its
    calibration was applied (scale_f multiplied f by it)."""
    predicted = float(tree.path_probs().sum()) - 1.0 if drafted else 0.0
    if source == "ngram":
        predicted /= eng.method_stats["ngram"].calibration
    eng.method_stats[source].observe(emitted, drafted, accepted, predicted)
    metrics.spec_method_steps.labels(source).inc()
    metrics.spec_method_emitted_tokens.labels(source).inc(emitted)
    if drafted:
        metrics.spec_method_draft_tokens.labels(source).inc(drafted)
        metrics.spec_method_accepted_tokens.labels(source).inc(accepted)


def record_finish(r: Request, reason: str) -> None:
    cls = r.req.slo_class or "custom"
    metrics.requests_total.labels(reason, cls).inc()
    if r.first_token_t is None:
        return
    ttft_ms = (r.first_token_t - r.arrival) * 1000.0
    metrics.ttft_seconds.labels(cls).observe(ttft_ms / 1000.0)
    if reason not in ("stop", "length"):
        return
    ttft_met = r.req.ttft_slo_ms is None or ttft_ms <= r.req.ttft_slo_ms
    metrics.ttft_slo_total.labels(cls, "attained" if ttft_met else "missed").inc()
    n = r.num_generated
    if n < 2 or r.last_token_t is None:
        return
    tpot_ms = (r.last_token_t - r.first_token_t) * 1000.0 / (n - 1)
    metrics.tpot_seconds.labels(cls).observe(tpot_ms / 1000.0)
    tpot_met = tpot_ms <= r.req.tpot_slo_ms
    metrics.tpot_slo_total.labels(cls, "attained" if tpot_met else "missed").inc()
    # The SLO is met when both are: a fast stream after a late first token is not.
    if ttft_met and tpot_met:
        metrics.slo_attained_total.labels(cls).inc()
        metrics.goodput_tokens_total.labels(cls).inc(n)
    else:
        metrics.slo_missed_total.labels(cls).inc()


def export_load(eng: Engine, load: UnitLoad, running: list[Request]) -> None:
    """The autoscaling signals: whether this unit can take more at its SLOs."""
    metrics.slo_pressure.set(load.pressure)
    metrics.predicted_tpot_seconds.set(load.tpot_ms(load.running + load.waiting + 1) / 1000.0)
    metrics.predicted_queue_seconds.set(
        load.prefill_queue_tokens * load.prefill_ms_per_token / 1000.0
    )
    now = eng.clock()
    decoding = [r for r in running if r.first_token_t is not None and not r.best_effort]
    # On track: its TPOT so far is within its SLO (what attainment will say of it).
    on_track = 0
    for r in decoding:
        elapsed_ms, decoded = r.elapsed_decoded(now)
        on_track += elapsed_ms <= r.req.tpot_slo_ms * max(decoded, 1)
    metrics.running_on_slo_ratio.set(on_track / len(decoding) if decoding else 1.0)
    metrics.draining.set(float(load.draining))
