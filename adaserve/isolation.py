"""Failure isolation: what concerns one request fails that request, not the batch.

Two kinds of failure reach the engine (torch-free, no clock reads here):

* **A request's own work** raises (its grammar matcher, logits context, tree, stop
  checks, detokenizer, stream): the engine knows whose it is and ends that request alone
  (`engine/lifecycle.py` `fail`: finish reason "error", its KV and draft state freed as an abort frees
  them); the other requests go on in the same iteration. `report` logs it once with the
  request id and counts it.
* **The batched part** raises (batch formation, selection, the forward): nothing says
  whose input broke it. The iteration's requests get their KV rebuilt from their
  committed tokens (recompute, as after a preemption) and become suspects: `Quarantine`
  has the next iterations carry one half of them at a time (bisection), and ends a
  request only once an iteration carrying it alone fails too. A transient failure so
  ends nobody, and one bad request among n costs about 2 log2(n) short iterations.
  Requests that fail only together pass the bisection (both halves of their group
  run clean) and fail the next ordinary iteration again: such a group's members get a
  strike each time, and a request with `MAX_STRIKES` ends, so they cost a few rebuilds,
  not one bisection after another forever.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from adaserve import metrics

log = logging.getLogger("adaserve.engine")

# Where a request's failure can happen, the label of adaserve_request_errors_total.
PHASES = (
    "intake",  # its detokenizer or grammar matcher being built
    "admit",  # its KV sequence being started (prefix-cache lookup)
    "prefill",  # the logits context of its first token (last prompt chunk)
    "tree",  # its draft tree: merging, scaling, the cut to the context window
    "constrain",  # its grammar masks and logits context for the forward
    "apply",  # its emitted tokens: stop checks, grammar advance, detokenizing, streaming
    "batch",  # the batched iteration failed whenever it carried this request, alone too
    "resync",  # rebuilding its KV after a failed iteration
)


def report(request_id: str, phase: str, exc: BaseException, traceback: bool = True) -> str:
    """Logs a request's failure once (with the traceback unless it was logged already),
    counts it, and returns the message its client gets."""
    metrics.request_errors_total.labels(phase).inc()
    log.error(
        "request %s failed (%s: %r); ending it alone",
        request_id,
        phase,
        exc,
        exc_info=exc if traceback else None,
    )
    return f"internal error in this request ({phase}: {type(exc).__name__})"


# Bisections a request's group passed whole after it failed together (each half ran
# clean): at this many the request ends. One can be a transient failure.
MAX_STRIKES = 2


@dataclass
class _Family:
    """The two halves of a group that failed: if both run clean, it failed together."""

    members: tuple[str, ...]
    open: int = 2  # halves not done yet
    failed: bool = False  # a half failed (or emptied): the pair says nothing


@dataclass
class _Group:
    members: tuple[str, ...]
    family: _Family | None = None


class Quarantine:
    """Suspects of failed iterations, in groups: while any remain, an iteration carries
    only the head group's requests. A group that runs clean is cleared; one that fails is
    split in halves, tried first; a request that fails alone is the culprit."""

    def __init__(self) -> None:
        self._groups: deque[_Group] = deque()
        self._strikes: dict[str, int] = {}

    @property
    def suspects(self) -> int:
        return sum(len(g.members) for g in self._groups)

    def allowed(self, running: Collection[str]) -> set[str] | None:
        """The requests the next iteration may carry (None: any); suspects that are no
        longer running (finished, preempted) are forgotten."""
        for i in [i for i in self._strikes if i not in running]:
            del self._strikes[i]
        while self._groups:
            g = self._groups[0]
            g.members = tuple(i for i in g.members if i in running)
            if g.members:
                return set(g.members)
            self._close(self._groups.popleft(), failed=True)  # says nothing of the pair
        return None

    def passed(self, carried: Collection[str]) -> list[str]:
        """An iteration carrying `carried` ran clean: they are no longer suspects.
        Returns the requests to end: those whose group failed together once more than
        MAX_STRIKES allows (both halves of it have now run clean)."""
        if not self._groups:
            return []
        g = self._groups[0]
        g.members = tuple(i for i in g.members if i not in carried)
        if g.members:
            return []
        return self._close(self._groups.popleft(), failed=False)

    def failed(self, carried: Sequence[str]) -> list[str]:
        """An iteration carrying `carried` failed; returns the culprits to end: the one
        request of an iteration that carried only it, when that iteration already ran in
        quarantine (a request alone in an ordinary iteration is tried once more)."""
        if not carried:
            return []
        rest: tuple[str, ...] = ()
        if self._groups and set(carried) <= set(self._groups[0].members):
            g = self._groups.popleft()
            if g.family is not None:  # a member failed: the family did not fail together
                g.family.failed = True
            rest = tuple(i for i in g.members if i not in carried)
            if rest:
                self._groups.appendleft(_Group(rest, g.family))
            else:
                self._close(g, failed=True)
            if len(carried) == 1:
                return list(carried)
        if len(carried) == 1:
            self._groups.appendleft(_Group(tuple(carried)))
            return []
        half = (len(carried) + 1) // 2
        family = _Family(tuple(carried))
        self._groups.appendleft(_Group(tuple(carried[half:]), family))
        self._groups.appendleft(_Group(tuple(carried[:half]), family))
        return []

    def _close(self, g: _Group, failed: bool) -> list[str]:
        """A group is done (`failed`: one of its members failed, or it emptied). When
        both halves of a failed group ran clean, the group failed only together: its
        members get a strike, and those at MAX_STRIKES are returned to end."""
        f = g.family
        if f is None:
            return []
        f.open -= 1
        f.failed = f.failed or failed
        if f.open or f.failed:
            return []
        out = []
        for i in f.members:
            self._strikes[i] = self._strikes.get(i, 0) + 1
            if self._strikes[i] >= MAX_STRIKES:
                out.append(i)
        return out
