"""How a request gets in: validated and judged at submit (any thread), then taken from
the inbox, ordered by priority and due time, and admitted while a running slot and KV
remain (the loop thread). Its prompt's cached prefix is taken here; the planner
prefills the rest in chunks.
"""

from __future__ import annotations

import math
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from adaserve import metrics
from adaserve.adaptive import plan_depth_width
from adaserve.batching import behind_tpot, hold_prompt
from adaserve.detokenize import IncrementalDetokenizer
from adaserve.engine.lifecycle import finish, flush_releases, guard
from adaserve.engine.planner import adaptive_settings, slo_first
from adaserve.engine.recovery import use_prefix_cache
from adaserve.engine.state import Request
from adaserve.features import FeatureRows
from adaserve.methods import USES_EAGLE, chain_tokens, check_available, resolve_method
from adaserve.request import GenerationRequest
from adaserve.slo import SLOVerdict
from adaserve.slo import judge as judge_slo
from adaserve.stream import RequestStream

if TYPE_CHECKING:
    from adaserve.engine.core import Engine

# A request without a TTFT SLO is prefilled as if its deadline were this far after its
# arrival: finite, so earliest-deadline order serves it eventually, and late enough that
# requests with a TTFT SLO go first.
UNSET_TTFT_ORDER_MS = 10_000.0
# Policy adaserve (`scheduler.slo_prefill`) admits a request no SLO waits on behind
# those one waits on, as it prefills them, for at most this long after its arrival:
# then it goes by its due time again, so none waits forever for a running slot.
SLO_FIRST_MAX_WAIT_S = 30.0


# ---- at submit (any thread) ------------------------------------------------------------


def validate(eng: Engine, req: GenerationRequest) -> None:
    """ValueError naming what is wrong with the request (400 / INVALID_ARGUMENT)."""
    sp = req.sampling
    if not req.prompt_token_ids:
        raise ValueError("prompt is empty")
    if sp.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if not (req.tpot_slo_ms > 0 and math.isfinite(req.tpot_slo_ms)):
        raise ValueError("tpot_slo_ms must be a positive number")
    if len(req.prompt_token_ids) >= eng.kv_tokens:
        raise ValueError(
            f"prompt ({len(req.prompt_token_ids)} tokens) is longer than the KV cache "
            f"holds ({eng.kv_tokens} tokens; engine.kv_memory_gb / kv_blocks size it)"
        )
    if len(req.prompt_token_ids) + sp.max_tokens > eng.max_model_len:
        raise ValueError(
            f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({sp.max_tokens}) "
            f"exceeds the model's context length ({eng.max_model_len})"
        )
    vocab = eng.target.vocab_size
    if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if any(t >= vocab for t in sp.token_ids()):
        raise ValueError(
            f"logit_bias, allowed_token_ids and bad_words: token ids must be in [0, {vocab})"
        )
    if sp.structured is not None:
        if eng.grammar is None:
            raise ValueError(f"{sp.structured.field}: this unit has no tokenizer")
        if sp.ignore_eos:
            raise ValueError(f"{sp.structured.field}: cannot be combined with ignore_eos")
    if sp.temperature < 0 or not (0 < sp.top_p <= 1) or sp.top_k < 0:
        raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 are required")
    check_available(method_of(eng, req), eng.methods)


def method_of(eng: Engine, req: GenerationRequest) -> str:
    """The request's speculation method: its own, its SLO class's, the default."""
    cls = eng.settings.slo.classes.get(req.slo_class or "")
    return resolve_method(
        req.speculation,
        cls.speculation if cls is not None else None,
        eng.settings.speculation.default_method,
    )


def judge(eng: Engine, req: GenerationRequest) -> SLOVerdict:
    """Admission's judgement, at submit (before any token): a TPOT SLO below the
    floor, or a TTFT SLO shorter than prefilling this prompt and those due before it
    takes at the best prefill rate this deployment reaches, is served best-effort.
    Under `slo_prefill` a prompt no SLO waits on is not before it, whatever its due
    time (`admission_order`)."""
    floor = eng.slo_floor()
    verdict = judge_slo(req.tpot_slo_ms, floor.tpot_ms, floor.depth)
    ttft = req.ttft_slo_ms
    if verdict.best_effort or ttft is None:
        return verdict
    deadline = eng.clock() + ttft / 1000.0
    ahead = sum(left for due, left, first in eng.pool.prefill_queue if first and due <= deadline)
    n = eng.settings.engine.max_batch_tokens
    need_ms = (ahead + len(req.prompt_token_ids)) * eng.latency.predict_ms(0, n) / n
    if need_ms <= ttft:
        return verdict
    return SLOVerdict(
        True,
        floor.tpot_ms,
        f"ttft_slo_ms {ttft:g} is below the ~{need_ms:.0f} ms this server needs to "
        f"prefill this prompt ({len(req.prompt_token_ids)} tokens) and the {ahead} "
        "prompt tokens due before it",
    )


# ---- each iteration (the loop thread) ------------------------------------------------


def intake(eng: Engine) -> bool:
    """The inbox taken in, deadlines expired, waiting requests admitted; whether any
    request is running (False: the iteration has nothing to forward)."""
    _drain_inbox(eng)
    _expire_deadlines(eng)
    _admit(eng)
    eng.pool.publish_prefill_queue(slo_first(eng))
    if not eng.pool.running:
        flush_releases(eng)
        return False
    return True


def _drain_inbox(eng: Engine) -> None:
    while True:
        try:
            item = eng.pool.inbox.get_nowait()
        except queue.Empty:
            return
        if item[0] == "submit":
            req, stream, arrival = item[1]
            r = _new_request(eng, req, stream, arrival)
            eng.pool.waiting.append(r)
            with guard(eng, r, "intake"):
                _prepare(eng, r)
        else:
            _abort(eng, item[1])


def _new_request(
    eng: Engine, req: GenerationRequest, stream: RequestStream, arrival: float
) -> Request:
    ttft = req.ttft_slo_ms if req.ttft_slo_ms is not None else UNSET_TTFT_ORDER_MS
    sp = req.sampling
    r = Request(
        req=req,
        stream=stream,
        arrival=arrival,
        tokens=list(req.prompt_token_ids),
        detok=None,
        generator=eng.target.make_generator(sp.seed),
        ttft_deadline=arrival + ttft / 1000.0,
        prefill_target=len(req.prompt_token_ids),
        method=method_of(eng, req),
        stop_ids=tuple(sp.stop_token_ids)
        + (() if sp.ignore_eos else tuple(eng.target.eos_token_ids)),
    )
    if sp.processes_logits:
        r.prompt_ids = np.asarray(req.prompt_token_ids, dtype=np.int32)
    if eng.feature_dim and r.method in USES_EAGLE:
        r.feats = FeatureRows(eng.feature_dim)
    # The draft model's sequence starts at the prompt's last draft_context tokens (an
    # EAGLE head reads the target's features of every position: all of them).
    window = eng.settings.speculation.draft_context
    if window is not None and not eng.feature_dim:
        r.draft_start = r.drafter_len = max(len(req.prompt_token_ids) - window, 0)
    # An unattainable SLO (judged at submit; policy `best_effort`, as `reject`
    # refused it there) is served best-effort and flagged, not refused.
    if stream.verdict.best_effort:
        metrics.best_effort_total.labels(req.slo_class or "custom").inc()
        r.best_effort = True
    return r


def _prepare(eng: Engine, r: Request) -> None:
    """The request's own helpers: its detokenizer (stop strings) and grammar matcher."""
    if eng.tokenizer is not None:
        r.detok = IncrementalDetokenizer(eng.tokenizer, stop=tuple(r.req.sampling.stop))
    structured = r.req.sampling.structured
    if structured is not None and eng.grammar is not None:
        try:  # compiled at submit by the service already: cached, cheap
            r.constraint = eng.grammar.constraint(structured, r.stop_ids)
        except (ValueError, RuntimeError) as exc:  # the client's grammar: its message
            finish(eng, r, "error", error=str(exc))


def _abort(eng: Engine, request_id: str) -> None:
    for r in eng.pool.waiting:
        if r.req.id == request_id:
            finish(eng, r, "abort")
            return
    r = eng.pool.running.get(request_id)
    if r is not None:
        finish(eng, r, "abort")


def _expire_deadlines(eng: Engine) -> None:
    now = eng.clock()
    for r in [*eng.pool.waiting, *eng.pool.running.values()]:
        if r.deadline is not None and now > r.deadline:
            finish(eng, r, "timeout", error="request deadline exceeded")


def _admit(eng: Engine) -> None:
    """Admit in (priority, due time) order (`admission_order`) while a running slot
    and free KV blocks above the watermark remain. Nothing is reserved ahead: a
    request holds blocks for what it has committed plus its current scratch, taken as
    it grows (and freed by preemption when they run out), so no request's size blocks
    another's admission. The prompt's longest cached prefix is taken from the prefix
    cache here; admitted requests are prefilled in chunks by the next iterations."""
    pool = eng.pool
    now = eng.clock()
    defer_lost(eng, now)
    if not pool.waiting:
        return
    pool.waiting.sort(key=lambda r: admission_order(eng, r, now))
    watermark = math.ceil(eng.settings.engine.kv_watermark * eng.target.num_blocks)
    # n > 1: a sibling waits until the prompt it shares is prefilled, then takes
    # that KV from the prefix cache instead of computing it again.
    unprefilled = {r.req.id for r in pool.waiting}
    unprefilled |= {r.req.id for r in pool.running.values() if r.prefilling}
    hold = _hold_prompts(eng)
    i = 0
    while i < len(pool.waiting) and len(pool.running) < eng.settings.engine.max_running:
        if eng.target.free_blocks() <= watermark:
            break
        r = pool.waiting[i]
        if r.req.fork_of is not None and r.req.fork_of in unprefilled:
            i += 1
            continue
        if hold is not None and hold(r):
            i += 1
            continue
        pool.waiting.pop(i)
        r.plain = relaxed(eng, r)
        tokens = r.tokens[: r.prefill_target]
        pool.running[r.req.id] = r
        with guard(eng, r, "admit"):
            r.prefilled = eng.target.add_sequence(r.req.id, tokens, use_cache=use_prefix_cache(r))
            metrics.prefix_cache_queries.inc(len(tokens))
            metrics.prefix_cache_hits.inc(r.prefilled)
    metrics.num_running.set(len(pool.running))
    metrics.num_waiting.set(len(pool.waiting))


def defer_lost(eng: Engine, now: float) -> None:
    """Policy adaserve with `scheduler.defer_lost_ttft`: a request not yet started whose
    first token can no longer meet its TTFT SLO (the deadline is nearer than prefilling
    what is left of its prompt alone takes, in max_batch_tokens chunks) is due from
    then on as if it had no TTFT SLO (UNSET_TTFT_ORDER_MS after its arrival), in the
    waiting queue and among the prompts being prefilled, and counted in
    adaserve_ttft_lost_requests_total. Its SLO is missed whatever happens next;
    earliest-deadline-first would serve it before the prompts that can still meet
    theirs and make them miss too (under overload, every one after it)."""
    sched = eng.settings.scheduler
    if sched.policy != "adaserve" or not sched.defer_lost_ttft:
        return
    cap = eng.settings.engine.max_batch_tokens
    # A whole chunk bounds every chunk's time where the latency curve rises with the
    # tokens: only a request within that bound of its deadline needs its own
    # prediction, so a long queue costs one comparison a request. (Where a measured
    # curve dips, a request is judged a few ms later, once inside the bound.)
    chunk_s = eng.latency.predict_ms(0, cap) / 1000.0
    for r in [*eng.pool.waiting, *eng.pool.running.values()]:
        if r.ttft_lost or r.num_generated > 0 or r.req.ttft_slo_ms is None:
            continue
        left = r.prefill_target - r.prefilled
        chunks = math.ceil(left / cap)
        slack_s = r.ttft_deadline - now
        if slack_s >= chunk_s * chunks:
            continue
        if slack_s < eng.latency.predict_ms(0, min(left, cap)) * chunks / 1000.0:
            r.ttft_lost = True
            r.ttft_deadline = max(r.ttft_deadline, r.arrival + UNSET_TTFT_ORDER_MS / 1000.0)
            metrics.ttft_lost_total.labels(r.req.slo_class or "custom").inc()


def admission_order(eng: Engine, r: Request, now: float) -> tuple[int, bool, float, float, float]:
    """The waiting queue's order, which matters when slots or KV gate admission:
    vLLM-style priority first (lower value first), then (policy adaserve with
    `slo_prefill`) the requests an SLO waits on, then the earliest due time, then the
    tighter TPOT SLO, then arrival. Due is the TTFT deadline of a request that has not
    started (the one prefill chunks are ordered by), so a tight TTFT SLO is admitted
    ahead of relaxed ones that came first; a request without a TTFT SLO is due
    UNSET_TTFT_ORDER_MS after its arrival, so such requests keep arrival order among
    themselves. A preempted request is due when its next token falls behind its TPOT
    SLO: a fixed instant, so it too reaches the front. `engine.admission_order:
    arrival` keeps vLLM's order instead: priority, then arrival.

    An SLO waits on a request that has a TTFT SLO it can still meet, or a first token
    already (preempted: its TPOT). `slo_prefill` prefills those first; admitting one
    that none waits on ahead of them, once its default due time came, only parked it in
    a running slot, its prompt behind theirs, while a prompt that could still meet its
    TTFT waited for that slot (the random sweep's slot-bound H100 and Qwen draws:
    BENCHMARKS.md, "Admission in the prefill's order"). Past SLO_FIRST_MAX_WAIT_S of
    waiting it goes by its due time again: none waits forever for a slot."""
    if eng.settings.engine.admission_order == "arrival":
        return (r.req.priority, False, 0.0, 0.0, r.arrival)
    due = r.ttft_deadline
    if r.num_generated > 0:
        elapsed, decoded = r.elapsed_decoded(now)
        due = now + (r.req.tpot_slo_ms * (decoded + 1) - elapsed) / 1000.0
    return (
        r.req.priority,
        slo_first(eng) and not r.slo_waits and now - r.arrival < SLO_FIRST_MAX_WAIT_S,
        due,
        r.req.tpot_slo_ms,
        r.arrival,
    )


def _hold_prompts(eng: Engine) -> Callable[[Request], bool] | None:
    """Policy adaserve with `scheduler.hold_prompts`, while a decoding request is
    behind its TPOT SLO: which waiting requests stay waiting this iteration (those
    with a TTFT SLO far enough from their deadline, batching.hold_prompt). None: admit
    as usual."""
    sched = eng.settings.scheduler
    if sched.policy != "adaserve" or not sched.hold_prompts:
        return None
    now = eng.clock()
    decoding = [
        r.decoding(now) for r in eng.pool.running.values() if not r.prefilling and not r.best_effort
    ]
    if not behind_tpot(decoding):
        return None
    if sched.yield_to_prefill and eng.ttft_short:
        return None
    n = eng.settings.engine.max_batch_tokens
    ms_per_token = eng.latency.predict_ms(0, n) / n
    prefill_queue = eng.pool.prefill_queue

    def hold(r: Request) -> bool:
        if r.req.ttft_slo_ms is None or r.num_generated > 0:
            return False  # no TTFT SLO to spend, or a preempted request's recompute
        # The queue as of the last iteration: it may hold this prompt already, which
        # then counts twice (the hold errs toward admitting).
        # With `yield_to_prefill`, every prompt queued counts, not only those due
        # before it: prompts that arrive later with earlier deadlines go first, and
        # a hold that misses the TTFT it spends loses more than it saved.
        ahead = sum(
            left
            for due, left, _ in prefill_queue
            if sched.yield_to_prefill or due <= r.ttft_deadline
        )
        return hold_prompt(r.ttft_deadline, now, ahead + r.prefill_target, ms_per_token)

    return hold


def relaxed(eng: Engine, r: Request) -> bool:
    """At admission (policy adaserve with `scheduler.draft_relaxed` off): whether
    `r` decodes plainly, not drafted for unless it falls behind its SLO. So when
    the drafter's prefill of its prompt costs more than drafts save over its output
    (`drafts_cost_more`), it shares the engine with other requests that have a TTFT
    SLO (prompts whose prefill the drafter's would delay, now or as they keep
    arriving) and `r`'s TPOT SLO is met by plain decoding of a full batch with every
    iteration stretched by prefill (prefill_stretch x the predicted plain iteration
    at max_running). Drafting for it would buy speed its SLO does not count, and
    costs the drafter's prefill of its prompt, target-side time every waiting
    prompt's TTFT pays for (a 4k-token prompt costs a small drafter ~0.1 s on the
    H100 profile): on prefill-heavy load that made speculation lose to not
    speculating (BENCHMARKS.md, "Random workloads"). Decided once: a request that
    switched back to drafting later would make the drafter catch up on its whole
    prompt in one forward, a stall for every request in it."""
    sched = eng.settings.scheduler
    if sched.policy != "adaserve" or sched.draft_relaxed:
        return False
    # Only where the drafter's prefill of its prompt costs more than drafts save over
    # its output: a request that finishes sooner frees its running slot for the
    # prompts behind it (the random sweep's draw 2 lost 0.23 of attainment to spec-4
    # where short prompts were not drafted for).
    if not drafts_cost_more(eng, r):
        return False
    if not any(
        w is not r and w.req.ttft_slo_ms is not None
        for w in [*eng.pool.waiting, *eng.pool.running.values()]
    ):
        return False
    settings = eng.settings.engine
    plain_ms = eng.tspec.predict_ms(settings.max_running) * settings.prefill_stretch
    return r.req.tpot_slo_ms >= plain_ms


def drafts_cost_more(eng: Engine, r: Request) -> bool:
    """Whether drafting for `r` would cost more forward time than it saves: the
    drafter's prefill of its prompt from its draft_start (its measured time per
    prompt token it ingests)
    against its max_tokens at a full batch's plain time per request-token, of which
    a request drafted for saves 1 - 1/E (E: the tokens a verification emits at the
    depth planned for a full batch, at the planner's acceptance). Before the drafter
    has ingested a prompt its cost is unknown (0): drafted for. The ratio of prompt to
    output where this turns is ~6 on the H100 profile and ~20 on the A100 ones (a small
    drafter beside a large target); the rule before, prompt >= max_tokens, kept requests
    with 1.6x longer prompts from drafts that would have freed their slots sooner (the
    random sweep: median violations ratio 1.00 -> 1.07 on seed 1)."""
    settings = eng.settings.engine
    n = settings.max_running
    adaptive = adaptive_settings(eng)  # the learned acceptance where it is learned
    depth, _ = plan_depth_width(n, eng.settings.scheduler.budget, adaptive)
    saved_ms = eng.tspec.predict_ms(n) / n * (1.0 - 1.0 / chain_tokens(adaptive.acceptance, depth))
    ingest_ms = (len(r.req.prompt_token_ids) - r.draft_start) * eng.costs.drafter_ingest_ms
    return ingest_ms > r.req.sampling.max_tokens * saved_ms
