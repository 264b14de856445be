"""When the batched part of an iteration fails, or a drafter loses a request's state:
the failure quarantine (adaserve/isolation.py) finds whose input broke the forward and
ends that request alone; the others' KV is rebuilt from their committed tokens, as
after a preemption, without leaving the running set."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from adaserve import metrics
from adaserve.engine.lifecycle import fail, flush_releases, guard, release_drafts
from adaserve.engine.planner import eligible
from adaserve.engine.state import Request

if TYPE_CHECKING:
    from adaserve.engine.core import Engine

log = logging.getLogger("adaserve.engine")


def iteration_failed(eng: Engine, exc: Exception) -> None:
    """The batched part of the iteration raised, so nobody knows whose input broke
    it: the quarantine ends a request that already failed alone and bisects the
    rest. The forward may have appended or committed KV for any of them that their
    tokens do not show yet: their KV is rebuilt from their committed tokens."""
    carried = eligible(eng) if eng.carrying is None else eng.carrying
    carried = [r for r in carried if not r.finished and r.req.id in eng.pool.running]
    ids = [r.req.id for r in carried]
    log.error("engine iteration failed carrying %s; isolating them", ids, exc_info=exc)
    culprits = set(eng.quarantine.failed(ids))
    for r in carried:
        if r.req.id in culprits:
            fail(eng, r, "batch", exc, traceback=False)  # logged just above
        else:
            with guard(eng, r, "resync"):
                resync(eng, r)
    flush_releases(eng)


def resync(eng: Engine, r: Request) -> None:
    """Recompute, as after a preemption, without leaving the running set: the KV of
    every committed token but the last (that one roots the next tree) is prefilled
    again, from the prefix cache where its blocks are whole; the drafters re-ingest."""
    eng.target.free(r.req.id)
    release_drafts(eng, r)
    r.prefill_target = len(r.tokens) - 1 if r.num_generated else r.num_prompt
    r.prefilled = eng.target.add_sequence(
        r.req.id, r.tokens[: r.prefill_target], use_cache=use_prefix_cache(r)
    )


def use_prefix_cache(r: Request) -> bool:
    """Whether the request's prefill may take KV from the prefix cache: not where
    it scores its prompt, nor where an EAGLE drafter needs the features of every
    position (the cache holds KV, not features: a hit would leave a gap)."""
    return not r.scores_prompt and r.feats is None


def recompute_features(eng: Engine) -> None:
    """Requests whose EAGLE drafter lost their state (a restarted drafter service,
    KV given up under pressure) have features only from the drafter's point on:
    the verifier recomputes them, prefilling the request's history again with
    features (as after a failed iteration), and the drafter takes it in full."""
    ids, eng.recompute = eng.recompute, set()
    for rid in sorted(ids):
        r = eng.pool.running.get(rid)
        if r is None or r.finished or r.feats is None:
            continue
        log.info("recomputing the features of %s for its EAGLE drafter", rid)
        metrics.drafter_resyncs_total.inc()
        with guard(eng, r, "resync"):
            resync(eng, r)
