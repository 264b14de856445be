"""Request state and the pool that holds it.

One thread, the engine's loop, owns every `Request`; other threads reach the pool only
through its inbox (`submit`, `abort`) and its live-id set (under its lock), and read the
request's output from its `RequestStream`.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from adaserve.batching import Decoding
from adaserve.detokenize import IncrementalDetokenizer
from adaserve.features import FeatureRows
from adaserve.grammar import Constraint
from adaserve.request import GenerationRequest, TokenLogprobs
from adaserve.stream import RequestStream
from adaserve.target import LogitsContext

if TYPE_CHECKING:
    from adaserve.engine.core import Engine
    from adaserve.sampling import TokenRng


@dataclass
class Request:
    """Engine-side mutable state of one request; touched only by the loop thread."""

    req: GenerationRequest
    stream: RequestStream
    arrival: float
    tokens: list[int]  # prompt + generated, all committed
    detok: IncrementalDetokenizer | None
    generator: TokenRng | None
    ttft_deadline: float  # engine clock; the prefill order (earliest first)
    best_effort: bool = False
    first_token_t: float | None = None
    last_token_t: float | None = None
    prefilled: int = 0  # tokens whose KV the target holds (prefix-cache hits included)
    # Tokens to hold before decoding: the prompt; after a preemption every token but the
    # last, which roots the next tree again (recompute, not swap).
    prefill_target: int = 0
    drafter_len: int = 0  # tokens the drafter holds as committed, from draft_start
    # The first token the draft model reads (speculation.draft_context): its sequence
    # is tokens[draft_start:], and the lengths it is sent count from there.
    draft_start: int = 0
    # Policy adaserve, `scheduler.draft_relaxed` off: the request's TPOT so far is above
    # its SLO (batching.behind_tpot), so it is drafted for even if relaxed.
    needs_drafts: bool = False
    # Admitted while other prompts with a TTFT SLO waited, with a TPOT SLO plain
    # decoding meets (admission.relaxed): not drafted for unless behind (needs_drafts).
    plain: bool = False
    # Its first token can no longer meet its TTFT SLO (scheduler.defer_lost_ttft): its
    # deadline now only orders it, as a request without a TTFT SLO's does.
    ttft_lost: bool = False
    ngram_len: int = 0  # tokens the n-gram drafter holds
    method: str = "auto"  # speculation method asked for (adaserve/methods.py)
    finished: bool = False
    constraint: Constraint | None = None  # structured output: the grammar's matcher
    prompt_ids: np.ndarray | None = None  # int32 [P], for the logits processors
    # Tokens that end the output (eos unless ignore_eos, stop_token_ids): min_tokens
    # holds them back, the grammar never consumes them.
    stop_ids: tuple[int, ...] = ()
    # prompt_logprobs: what the prefill chunks scored so far (prompt tokens 1, 2, ...)
    prompt_lp: list[TokenLogprobs] = field(default_factory=list)
    # The target's features an EAGLE drafter still needs (adaserve/features.py); None
    # where the unit has none or the request's method never uses it.
    feats: FeatureRows | None = None

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_target

    @property
    def scores_prompt(self) -> bool:
        """Its prefill still owes the prompt's logprobs (sent with the first token): the
        prompt is computed in full, never taken from the prefix cache."""
        return self.req.sampling.prompt_logprobs is not None and self.num_generated == 0

    @property
    def deadline(self) -> float | None:
        t = self.req.timeout_s
        return None if t is None else self.arrival + t

    @property
    def ttft_bound(self) -> bool:
        """A TTFT SLO, not yet lost, waits on its first token."""
        return self.req.ttft_slo_ms is not None and self.num_generated == 0 and not self.ttft_lost

    @property
    def slo_waits(self) -> bool:
        """An SLO waits on its prefill (what policy adaserve's `slo_prefill` prefills
        first): a TTFT SLO it can still meet, or a first token already (preempted: its
        TPOT)."""
        return self.ttft_bound or self.num_generated > 0

    def elapsed_decoded(self, now: float) -> tuple[float, int]:
        """(l_r ms since the first token, o_r tokens decoded since it): the two numbers
        A(r) reads (adaserve/slo.py)."""
        elapsed = (now - self.first_token_t) * 1000.0 if self.first_token_t else 0.0
        return elapsed, max(self.num_generated - 1, 0)

    def decoding(self, now: float) -> Decoding:
        """Its TPOT progress as batch formation and the prompt hold read it."""
        elapsed, decoded = self.elapsed_decoded(now)
        return Decoding(self.req.id, self.req.tpot_slo_ms, elapsed, decoded, self.best_effort)

    def logits_context(self, masks: np.ndarray | None) -> LogitsContext | None:
        """What the target needs to process this request's rows (penalties, bias,
        grammar `masks`...); None: nothing to do."""
        if not self.req.sampling.processes_logits or self.prompt_ids is None:
            return None
        output = np.asarray(self.tokens[self.num_prompt :], dtype=np.int32)
        return LogitsContext(self.req.sampling, self.prompt_ids, output, self.stop_ids, masks)


# What other threads hand the loop: a submission (with its arrival time) or an abort.
InboxItem = (
    tuple[Literal["submit"], tuple[GenerationRequest, RequestStream, float]]
    | tuple[Literal["abort"], str]
)


class RequestPool:
    """The requests the engine holds: waiting for admission, running (admitted: being
    prefilled or decoding), and what other threads queued for the loop."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        # Ids of submitted, not yet retired requests: a second request under a live id
        # would share the first one's KV sequence and fail the whole batch.
        self._live_ids: set[str] = set()
        self._live_lock = threading.Lock()
        # (TTFT deadline s, prompt tokens left, whether it is prefilled before a new
        # prompt with a TTFT SLO due after it) of every prompt waiting for or in
        # prefill, republished by the loop thread each step: submit reads it to judge a
        # TTFT SLO.
        self.prefill_queue: tuple[tuple[float, int, bool], ...] = ()

    def put(self, item: InboxItem) -> None:
        self.inbox.put(item)
        self.wake.set()

    def claim(self, request_id: str) -> None:
        """Mark an id live (any thread); ValueError if it already is."""
        with self._live_lock:
            if request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._live_ids.add(request_id)

    def release(self, request_id: str) -> None:
        with self._live_lock:
            self._live_ids.discard(request_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or not self.inbox.empty())

    def publish_prefill_queue(self, slo_first: bool) -> None:
        """`slo_first`: prompts no SLO waits on go after those one waits on, whatever
        their due time (policy adaserve's `slo_prefill`)."""
        self.prefill_queue = tuple(
            (r.ttft_deadline, r.prefill_target - r.prefilled, not slo_first or r.slo_waits)
            for r in [*self.waiting, *self.running.values()]
            if r.prefilling
        )


def draftable(eng: Engine, r: Request) -> bool:
    """Whether the model drafter drafts for `r` (and ingests its prompt)."""
    return r.method in eng.uses_drafter and not (r.plain and not r.needs_drafts)
