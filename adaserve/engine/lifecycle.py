"""How a request leaves the engine: finished (its last delta sent, then retired), failed
by its own work (`guard`, `fail`: the others go on), and what retiring frees (its KV,
its state in the drafters)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from adaserve import metrics
from adaserve.engine.state import Request
from adaserve.engine.telemetry import record_finish
from adaserve.features import FeatureRows
from adaserve.isolation import report
from adaserve.request import TokenDelta

if TYPE_CHECKING:
    from adaserve.engine.core import Engine

log = logging.getLogger("adaserve.engine")


def finish(eng: Engine, r: Request, reason: str, error: str | None = None) -> None:
    """Ends `r` with a final delta of no tokens (abort, timeout, error)."""
    if r.finished:
        return
    delta = TokenDelta(
        token_ids=(),
        text="",
        finish_reason=reason,
        num_prompt_tokens=r.num_prompt,
        num_generated=r.num_generated,
        best_effort=r.best_effort,
        error=error,
    )
    try:
        r.stream.put(delta)
    except Exception as exc:  # a broken stream must not keep the request's state
        log.warning("request %s: its stream refused the final delta (%r)", r.req.id, exc)
    retire(eng, r, reason)


def retire(eng: Engine, r: Request, reason: str) -> None:
    r.finished = True
    pool = eng.pool
    pool.release(r.req.id)
    if r in pool.waiting:
        pool.waiting.remove(r)
    if pool.running.pop(r.req.id, None) is not None:
        try:
            eng.target.free(r.req.id)
        except Exception:  # its KV accounting is broken: the others' still holds
            log.exception("request %s: freeing its KV failed", r.req.id)
        release_drafts(eng, r)
    record_finish(r, reason)
    metrics.num_running.set(len(pool.running))
    metrics.num_waiting.set(len(pool.waiting))


def release_drafts(eng: Engine, r: Request) -> None:
    """Drops the request's state in the drafters (batched: `flush_releases` sends)."""
    if eng.drafter is not None and r.drafter_len > r.draft_start:
        eng.drafter.release([r.req.id])
    if eng.ngram is not None and r.ngram_len:
        eng.ngram.release([r.req.id])
    r.drafter_len, r.ngram_len = r.draft_start, 0
    if r.feats is not None:  # the recompute that follows computes them again
        r.feats = FeatureRows(eng.feature_dim)


def flush_releases(eng: Engine) -> None:
    for drafter in (eng.drafter, eng.ngram):
        if drafter is not None:
            drafter.flush()


@contextmanager
def guard(eng: Engine, r: Request, phase: str) -> Iterator[None]:
    """Work of one request's own: an exception there ends that request alone."""
    try:
        yield
    except Exception as exc:
        fail(eng, r, phase, exc)


def fail(eng: Engine, r: Request, phase: str, exc: Exception, traceback: bool = True) -> None:
    """Ends a request whose own work failed: "error" to its client, its KV and draft
    state freed as an abort frees them; the other requests go on."""
    if not r.finished:
        finish(eng, r, "error", error=report(r.req.id, phase, exc, traceback))
