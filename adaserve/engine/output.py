"""Step 4 of the iteration: what the forward verified becomes each request's output.

Accepted tokens are committed one at a time as plain decoding would emit them (stop
strings, stop tokens, the length cap end the output exactly where plain decoding
would), detokenized and streamed; a finished request is retired. Then the failure
quarantine learns which suspects ran clean, features an EAGLE drafter lost are
recomputed, and the drafters' releases are sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaserve.engine.contracts import IterationTiming, VerifyBatch
from adaserve.engine.drafting import keep_features
from adaserve.engine.lifecycle import fail, finish, flush_releases, guard, retire
from adaserve.engine.recovery import recompute_features
from adaserve.engine.state import Request
from adaserve.engine.telemetry import record_spec
from adaserve.request import TokenDelta, TokenLogprobs
from adaserve.target import ForwardResult

if TYPE_CHECKING:
    from adaserve.engine.core import Engine


def commit(eng: Engine, batch: VerifyBatch, result: ForwardResult, timing: IterationTiming) -> None:
    """The forward's result applied to the requests it carried."""
    plan, now = batch.plan, timing.verified
    keep_features(plan, result)
    for r, tree, source, res in zip(
        plan.decoding, batch.trees, batch.sources, result.verified, strict=True
    ):
        with guard(eng, r, "apply"):
            record_spec(eng, source, tree, res.accepted_nodes, len(res.emitted_tokens))
            apply_tokens(eng, r, res.emitted_tokens.tolist(), now, res.logprobs)
    if plan.decoding:
        emitted = sum(len(res.emitted_tokens) for res in result.verified)
        iteration_ms = (timing.verified - timing.start) * 1000.0
        eng.costs.observe_tpot(len(plan.decoding), emitted, iteration_ms)
    first_lp = result.first_logprobs or [None] * len(plan.chunks)
    prompt_lp = result.prompt_logprobs or [None] * len(plan.chunks)
    for (r, chunk), first, lp, plp in zip(
        plan.chunks, result.first_tokens, first_lp, prompt_lp, strict=True
    ):
        r.prefilled += len(chunk.tokens)
        if plp is not None:
            r.prompt_lp.append(plp)
        if first is not None:
            with guard(eng, r, "apply"):
                apply_tokens(eng, r, [first], now, lp, prompt_logprobs(r))
    # A suspect is cleared by a tree of its own: a prompt chunk may not be what broke.
    together = set(eng.quarantine.passed([r.req.id for r in plan.decoding]))
    for r in [r for r in eng.pool.running.values() if r.req.id in together]:
        fail(eng, r, "batch", RuntimeError("iterations fail whenever it runs with others"), False)
    if eng.recompute:
        recompute_features(eng)
    flush_releases(eng)


def apply_tokens(
    eng: Engine,
    r: Request,
    emitted: list[int],
    now: float,
    logprobs: TokenLogprobs | None = None,
    prompt_logprobs: TokenLogprobs | None = None,
) -> None:
    """Commit emitted tokens to the request: stop checks, detokenize, stream."""
    if r.finished:
        return
    sp = r.req.sampling
    stops = set(sp.stop_token_ids)
    if not sp.ignore_eos:
        stops.update(eng.target.eos_token_ids)
    reason: str | None = None
    kept: list[int] = []
    text = ""
    stopped = False  # a stop string ended it: its held-back tail is never released
    for tok in emitted:
        kept.append(tok)
        if r.detok is not None:
            # One token at a time, as plain decoding feeds it: a speculative step
            # accepts several tokens at once, and the output must end exactly where
            # plain decoding would have stopped on a stop string (token ids, usage,
            # logprobs), including one that spans token boundaries. eos/stop ids
            # are special tokens: skip_special_tokens keeps them out of the text.
            piece, hit_stop = r.detok.add([tok])
            text += piece
            if hit_stop:
                reason, stopped = "stop", True
                break
        if tok in stops:
            reason = "stop"
            break
        if r.num_generated + len(kept) >= sp.max_tokens:
            reason = "length"
            break
    if reason is not None and r.detok is not None and not stopped:
        text += r.detok.flush()
    r.tokens.extend(kept)
    if r.constraint is not None and not r.constraint.advance(kept):
        finish(eng, r, "error", error="structured output: the grammar refused a token")
        return
    first = r.first_token_t is None and bool(kept)
    if first:
        r.first_token_t = now
    if kept:
        r.last_token_t = now
    if len(r.tokens) + 1 >= eng.max_model_len and reason is None:
        reason = "length"
        if r.detok is not None:
            text += r.detok.flush()
    r.stream.put(
        TokenDelta(
            token_ids=tuple(kept),
            text=text,
            finish_reason=reason,
            num_prompt_tokens=r.num_prompt,
            num_generated=r.num_generated,
            ttft_ms=(now - r.arrival) * 1000.0 if first else None,
            best_effort=r.best_effort,
            logprobs=None if logprobs is None else logprobs.head(len(kept)),
            prompt_logprobs=prompt_logprobs,
        )
    )
    if reason is not None:
        retire(eng, r, reason)


def prompt_logprobs(r: Request) -> TokenLogprobs | None:
    """The prompt's logprobs its prefill gathered, sent with its first token; every
    prompt token but the first must be scored (RuntimeError: the request fails)."""
    if not r.scores_prompt:
        return None
    got = TokenLogprobs.concat(r.prompt_lp) if r.prompt_lp else None
    n = 0 if got is None else got.logprobs.shape[0]
    if n != r.num_prompt - 1 or got is None:
        raise RuntimeError(
            f"prompt logprobs: prefill scored {n} of the prompt's {r.num_prompt - 1} tokens"
        )
    r.prompt_lp = []
    return got
