"""Failure isolation: what concerns one request fails that request, not the batch.

Two kinds of failure reach the engine (torch-free, no clock reads here):

* **A request's own work** raises (its grammar matcher, logits context, tree, stop
  checks, detokenizer, stream): the engine knows whose it is and ends that request alone
  (`Engine._fail`: finish reason "error", its KV and draft state freed as an abort frees
  them); the other requests go on in the same iteration. `report` logs it once with the
  request id and counts it.
* **The batched part** raises (batch formation, selection, the forward): nothing says
  whose input broke it. The iteration's requests get their KV rebuilt from their
  committed tokens (recompute, as after a preemption) and become suspects: `Quarantine`
  has the next iterations carry one half of them at a time (bisection), and ends a
  request only once an iteration carrying it alone fails too. A transient failure so
  ends nobody, and one bad request among n costs about 2 log2(n) short iterations.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Sequence

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


class Quarantine:
    """Suspects of failed iterations, in groups: while any remain, an iteration carries
    only the head group's requests. A group that runs clean is cleared; one that fails is
    split in halves, tried first; a request that fails alone is the culprit."""

    def __init__(self) -> None:
        self._groups: deque[tuple[str, ...]] = deque()

    @property
    def suspects(self) -> int:
        return sum(len(g) for g in self._groups)

    def allowed(self, running: Collection[str]) -> set[str] | None:
        """The requests the next iteration may carry (None: any); suspects that are no
        longer running (finished, preempted) are forgotten."""
        while self._groups:
            head = tuple(i for i in self._groups[0] if i in running)
            if head:
                self._groups[0] = head
                return set(head)
            self._groups.popleft()
        return None

    def passed(self, carried: Collection[str]) -> None:
        """An iteration carrying `carried` ran clean: they are no longer suspects."""
        if self._groups:
            rest = tuple(i for i in self._groups[0] if i not in carried)
            if rest:
                self._groups[0] = rest
            else:
                self._groups.popleft()

    def failed(self, carried: Sequence[str]) -> list[str]:
        """An iteration carrying `carried` failed; returns the culprits to end: the one
        request of an iteration that carried only it, when that iteration already ran in
        quarantine (a request alone in an ordinary iteration is tried once more)."""
        if not carried:
            return []
        isolated = bool(self._groups) and set(carried) <= set(self._groups[0])
        rest: tuple[str, ...] = ()
        if isolated:
            rest = tuple(i for i in self._groups.popleft() if i not in carried)
            if len(carried) == 1:
                if rest:
                    self._groups.appendleft(rest)
                return list(carried)
        half = (len(carried) + 1) // 2
        groups = [tuple(carried[:half]), tuple(carried[half:]), rest]
        for g in reversed(groups):
            if g:
                self._groups.appendleft(g)
        return []
