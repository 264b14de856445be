"""Batch formation alone (adaserve/batching.py, no torch): the token budget is never
exceeded, every prompt is eventually prefilled, prompts go in TTFT-deadline order, a
steady stream of tight requests never starves a relaxed prompt, and the iteration
outlasts the stretch only for TTFT deadlines, and then not the running requests' TPOT
slack."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.batching import (
    BatchLimits,
    Decoding,
    Prefilling,
    behind_tpot,
    form_batch,
    hold_prompt,
    slo_draft_tokens,
    slo_tree_budget,
)
from adaserve.latency import Curve

# A GPU-like forward: flat to the knee (64 tokens), linear after.
GPU = Curve.knee(20.0, 64)  # (tree, prefill, context) -> ms
LIMITS = BatchLimits(tree_budget=64, max_batch_tokens=2048, min_prefill_tokens=16)
LIMITS_2X = BatchLimits(64, 4096, 1, stretch=2.0)


def dec(i: int, slo: float = 50.0, elapsed: float = 0.0, decoded: int = 0) -> Decoding:
    return Decoding(f"d{i}", slo, elapsed, decoded)


def pre(i: int, remaining: int, deadline: float = 1e4, **kw) -> Prefilling:
    return Prefilling(f"p{i}", remaining, deadline, **kw)


def test_the_module_imports_no_torch() -> None:
    tree = ast.parse(Path("adaserve/batching.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.split(".")[0] == "torch" for m in names)


def test_decode_only_keeps_the_whole_knee_budget() -> None:
    plan = form_batch([dec(i) for i in range(3)], [], LIMITS, GPU)
    assert plan.chunks == () and plan.tree_budget == 64
    many = form_batch([dec(i) for i in range(100)], [], LIMITS, GPU)
    assert many.tree_budget == 100  # every root fits, whatever the budget


def test_an_idle_server_prefills_a_full_batch_in_deadline_order() -> None:
    prompts = [pre(0, 900, deadline=500.0), pre(1, 1500, deadline=100.0), pre(2, 50, 300.0)]
    plan = form_batch([], prompts, LIMITS, GPU)
    assert plan.chunks == (("p1", 1500), ("p2", 50), ("p0", 498))
    assert plan.prefill_tokens == LIMITS.max_batch_tokens


def test_ties_on_deadline_go_by_priority_then_arrival() -> None:
    prompts = [
        pre(0, 10, deadline=100.0, priority=1, arrival_ms=0.0),
        pre(1, 10, deadline=100.0, priority=0, arrival_ms=5.0),
        pre(2, 10, deadline=100.0, priority=0, arrival_ms=1.0),
    ]
    plan = form_batch([], prompts, LIMITS, GPU)
    assert [rid for rid, _ in plan.chunks] == ["p2", "p1", "p0"]


def test_prefill_rides_in_the_time_the_decoders_allow() -> None:
    """Two relaxed decoders: the iteration may stretch to `stretch` x their decode work;
    the chunk is as large as fits in that time on the latency model."""
    decoders = [dec(0, slo=1000.0), dec(1, slo=1000.0)]
    plan = form_batch(decoders, [pre(0, 5000)], LIMITS, GPU)
    decode_ms = GPU(2, 0)
    assert plan.time_limit_ms == pytest.approx(LIMITS.stretch * decode_ms)
    assert GPU(2, plan.prefill_tokens) <= plan.time_limit_ms
    assert GPU(2, plan.prefill_tokens + 1) > plan.time_limit_ms


def test_tight_tpot_slos_do_not_shrink_the_stretch() -> None:
    """The stretch is not capped by the TPOT SLOs: the prefill work is the same whether
    it runs now or later, and a TPOT SLO is an average over the whole output, so a
    request on the edge of its SLO still lets a chunk stretch the iteration."""
    decoders = [dec(0, slo=1000.0), dec(1, slo=1.2 * GPU(2, 0))]
    plan = form_batch(decoders, [pre(0, 5000)], LIMITS, GPU)
    assert plan.time_limit_ms == pytest.approx(LIMITS.stretch * GPU(2, 0))
    relaxed = form_batch([dec(0, slo=1000.0), dec(1, slo=1000.0)], [pre(0, 5000)], LIMITS, GPU)
    assert plan.prefill_tokens == relaxed.prefill_tokens > 0


def test_min_prefill_is_guaranteed_when_the_stretch_leaves_nothing() -> None:
    linear = Curve((1.0, 2.0), (10.0, 20.0))  # every token costs: no free room below a knee
    limits = BatchLimits(64, 2048, 16, stretch=1.0)
    decoders = [dec(0, slo=1.0)]  # far behind: no slack a deadline could use either
    plan = form_batch(decoders, [pre(0, 5000, deadline=1.0), pre(1, 8)], limits, linear)
    assert plan.prefill_tokens == limits.min_prefill_tokens
    # Below a knee, tokens are free: a flat curve fills the forward up to it.
    plan = form_batch(decoders, [pre(0, 5000)], limits, GPU)
    assert plan.prefill_tokens == 63 and plan.time_limit_ms == GPU(1, 0)


def test_requests_behind_schedule_are_reserved_tree_tokens() -> None:
    limits = BatchLimits(64, 2048, 16, depth=4, width=2, acceptance=0.8)
    on_time = dec(0, slo=50.0, elapsed=1000.0, decoded=40)  # 25 ms/token so far
    behind = dec(1, slo=50.0, elapsed=1000.0, decoded=18)  # needs ~3 tokens now
    k = slo_draft_tokens([on_time, behind], limits)
    assert k[0] == 0 and 1 <= k[1] <= 4
    # A(r) = (1000 + 50) / 50 - 18 = 3: the chain of k nodes is expected to give >= 3
    assert sum(0.8**j for j in range(k[1] + 1)) >= 3 - 1e-9
    plan = form_batch([on_time, behind], [pre(0, 5000)], limits, GPU)
    assert plan.slo_tree_tokens == 2 + int(k.sum())
    assert plan.tree_budget >= plan.slo_tree_tokens


def test_urgent_deadlines_take_the_throughput_trees_not_the_slo_trees() -> None:
    limits = BatchLimits(64, 2048, 16, stretch=1.5, depth=4, width=2, acceptance=0.8)
    decoders = [dec(i, slo=1000.0) for i in range(6)]
    relaxed = form_batch(decoders, [pre(0, 4000, deadline=1e7)], limits, GPU)
    urgent = form_batch(decoders, [pre(0, 4000, deadline=10.0)], limits, GPU)
    assert urgent.prefill_tokens > relaxed.prefill_tokens
    assert urgent.tree_budget < relaxed.tree_budget
    assert urgent.tree_budget >= urgent.slo_tree_tokens == 6


@settings(max_examples=200, deadline=None)
@given(
    slos=st.lists(st.floats(5.0, 500.0), min_size=0, max_size=12),
    prompts=st.lists(
        st.tuples(st.integers(1, 3000), st.floats(-100.0, 20_000.0)), min_size=1, max_size=8
    ),
    depth=st.integers(0, 5),
    max_batch=st.integers(64, 4096),
)
def test_budget_never_exceeded_and_prefill_always_progresses(slos, prompts, depth, max_batch):
    limits = BatchLimits(32, max_batch, 16, depth=depth, width=2, acceptance=0.7)
    decoding = [dec(i, slo=s, elapsed=100.0 * i, decoded=3 * i) for i, s in enumerate(slos)]
    prefilling = [pre(i, r, deadline=d) for i, (r, d) in enumerate(prompts)]
    plan = form_batch(decoding, prefilling, limits, GPU, overhead_ms=3.0, now_ms=0.0)
    remaining = {p.id: p.remaining for p in prefilling}
    assert plan.prefill_tokens >= min(16, sum(remaining.values()))  # progress every time
    assert all(0 < n <= remaining[rid] for rid, n in plan.chunks)
    assert len({rid for rid, _ in plan.chunks}) == len(plan.chunks)
    # chunks follow the deadline order, and only the last may be partial
    order = sorted(prefilling, key=lambda p: (p.deadline_ms, p.priority, p.arrival_ms, p.id))
    ids = [rid for rid, _ in plan.chunks]
    assert ids == [p.id for p in order[: len(ids)]]
    assert all(n == remaining[rid] for rid, n in plan.chunks[:-1])
    assert plan.tree_budget >= len(decoding)
    if decoding:
        assert plan.tree_budget + plan.prefill_tokens <= max(
            max_batch, plan.slo_tree_tokens + limits.min_prefill_tokens
        )
    else:
        assert plan.prefill_tokens <= max_batch


def simulate_planner(
    tight_every: int, relaxed_prompt: int, steps: int, limits: BatchLimits
) -> tuple[int | None, list[int]]:
    """A toy engine around form_batch: a tight request arrives every `tight_every`
    iterations with a 200-token prompt, decodes 30 tokens, leaves; one relaxed request
    with a long prompt and a late deadline arrives first. Returns the iteration the
    relaxed prompt finished prefilling (None: never) and each tight prompt's TTFT in
    iterations."""
    now, t_iter = 0.0, 25.0
    prefill: dict[str, list[float]] = {"relaxed": [relaxed_prompt, 60_000.0, 0.0]}
    decoding: dict[str, int] = {}
    started: dict[str, float] = {}
    done_at, ttfts = None, []
    for step in range(steps):
        if step % tight_every == 0:
            rid = f"t{step}"
            prefill[rid] = [200, now + 250.0, now]
            started[rid] = step
        plan = form_batch(
            [Decoding(r, 30.0, 0.0, 0) for r in decoding],
            [Prefilling(r, int(p[0]), p[1], 0, p[2]) for r, p in prefill.items()],
            limits,
            GPU,
            now_ms=now,
        )
        for rid, n in plan.chunks:
            prefill[rid][0] -= n
            if prefill[rid][0] == 0:
                del prefill[rid]
                if rid == "relaxed":
                    done_at = step
                else:
                    decoding[rid] = 30
                    ttfts.append(step - started[rid])
        for rid in list(decoding):
            decoding[rid] -= 1
            if decoding[rid] == 0:
                del decoding[rid]
        now += t_iter
    return done_at, ttfts


def test_a_steady_stream_of_tight_requests_does_not_starve_a_relaxed_prompt() -> None:
    limits = BatchLimits(64, 512, 16, depth=2, width=1, acceptance=0.7)
    done_at, ttfts = simulate_planner(
        tight_every=3, relaxed_prompt=20_000, steps=4000, limits=limits
    )
    assert done_at is not None  # the relaxed prompt got through
    assert ttfts and np.median(ttfts) <= 10  # and the tight ones were served meanwhile


def test_a_chunk_deep_in_its_prompt_is_smaller_for_the_same_time() -> None:
    """Attention over the prompt's earlier tokens costs what the curve's context_ms says
    per thousand (query, key) pairs: deeper chunks get fewer tokens in the same time."""
    curve = Curve((1.0, 64.0, 512.0), (10.0, 20.0, 120.0), context_ms=0.5)
    decoders = [dec(0, slo=1000.0), dec(1, slo=1000.0)]
    limits = BatchLimits(tree_budget=64, max_batch_tokens=2048, min_prefill_tokens=1)
    start = form_batch(decoders, [pre(0, 4000, deadline=1e9)], limits, curve)
    deep = form_batch(decoders, [pre(0, 4000, deadline=1e9, done=1500)], limits, curve)
    assert 0 < deep.prefill_tokens < start.prefill_tokens
    assert deep.prefill_context == pytest.approx(deep.prefill_tokens * 1500 / 1000)
    p = deep.prefill_tokens
    assert curve(2, p, deep.prefill_context) <= deep.time_limit_ms
    assert curve(2, p + 1, (p + 1) * 1.5) > deep.time_limit_ms


def test_ttft_deadlines_may_stretch_an_iteration_up_to_the_tpot_slo() -> None:
    """With no room left by the stretch, an urgent prompt still gets prefill: the
    iteration may run longer, up to what the decoders' TPOT SLO allows, no further."""
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))  # 1 ms per token past the first
    limits = BatchLimits(64, 4096, 1, stretch=1.0)
    decoders = [dec(0, slo=100.0), dec(1, slo=400.0)]
    relaxed = form_batch(decoders, [pre(0, 3000, deadline=1e9)], limits, linear)
    urgent = form_batch(decoders, [pre(0, 3000, deadline=5.0)], limits, linear)
    assert relaxed.prefill_tokens == 1  # the stretch leaves nothing, min_prefill gives 1
    assert urgent.prefill_tokens > relaxed.prefill_tokens
    assert urgent.time_limit_ms <= 100.0 + 1e-9  # the tightest TPOT SLO (no drafting)
    assert linear(2, urgent.prefill_tokens, 0.0) <= 100.0
    assert linear(2, urgent.prefill_tokens + 1, 0.0) > 100.0


def test_a_decoder_ahead_of_its_slo_lends_its_slack_to_a_deadline() -> None:
    """T <= t_r (o_r + E) - l_r: a request 20 tokens in after 1 s on a 100 ms SLO could
    wait 1.1 s and still be on schedule; one that is behind is left to selection and
    does not hold the iteration to the decode step."""
    linear = Curve((1.0, 5000.0), (10.0, 5009.0))
    limits = BatchLimits(64, 8192, 1, stretch=1.0)
    ahead = dec(0, slo=100.0, elapsed=1000.0, decoded=20)
    behind = dec(1, slo=100.0, elapsed=5000.0, decoded=20)
    plan = form_batch([ahead, behind], [pre(0, 6000, deadline=5.0)], limits, linear)
    assert 100.0 < plan.time_limit_ms <= 100.0 * 21 - 1000.0 + 1e-9
    assert linear(2, plan.prefill_tokens + 1, 0.0) > 1100.0


def test_a_deadline_stretches_an_iteration_only_as_far_as_the_bonus_token_keeps_pace() -> None:
    """T <= t_r (o_r + 1) - l_r, not t_r (o_r + E) - l_r: a request the bonus token keeps
    on schedule is not bet on its tree's acceptance (E = 1 + .8 + .64 + .512 here,
    which would allow 1295 ms); one that needs its tree to keep pace counts at E."""
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))  # 1 ms per token past the first
    limits = BatchLimits(64, 8192, 1, stretch=1.0, depth=3, acceptance=0.8)
    ahead = dec(0, slo=100.0, elapsed=1000.0, decoded=20)  # certain: 1100 ms
    plan = form_batch([ahead], [pre(0, 6000, deadline=5.0)], limits, linear)
    assert 1000.0 < plan.time_limit_ms <= 100.0 * 21 - 1000.0 + 1e-9
    assert linear(4, plan.prefill_tokens + 1, 0.0) > 1100.0
    # 50 * 21 - 1045 = 5 ms: shorter than any iteration, so its tree must deliver.
    needs_tree = dec(1, slo=50.0, elapsed=1045.0, decoded=20)
    both = form_batch([ahead, needs_tree], [pre(0, 6000, deadline=5.0)], limits, linear)
    e = 1 + 0.8 + 0.8**2 + 0.8**3
    assert 50.0 < both.time_limit_ms <= 50.0 * (20 + e) - 1045.0 + 1e-9


@pytest.mark.parametrize("remaining", range(20, 80, 3))
def test_a_prompt_the_plan_says_is_on_time_completes_by_its_deadline(remaining) -> None:
    """Where the plan does not call the deadlines short, the prompt's chunks at this
    iteration's size and length complete it in the whole iterations before its deadline:
    its first token comes at the end of the last one, so 5.5 iterations' time is 5 of
    prefill. (The decoder has no slack to stretch the iteration past the stretch.)"""
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))  # 1 ms per token past the first
    limits = BatchLimits(64, 8192, 1, stretch=2.0)
    prompt = pre(0, remaining, deadline=110.0)
    plan = form_batch([dec(0, slo=1.0)], [prompt], limits, linear)
    assert plan.time_limit_ms == pytest.approx(20.0)
    if not plan.ttft_short:
        iterations = math.ceil(remaining / plan.prefill_tokens)
        assert iterations * plan.time_limit_ms <= 110.0 + 1e-9


def test_the_tree_budget_follows_the_tightest_slo() -> None:
    # GPU: 20 ms flat to 64 tokens, 40 ms at 128. A request expecting 2 tokens per
    # iteration with a 15 ms SLO keeps pace at 30 ms: 96 tree tokens, past the knee.
    def decode_ms(t: int) -> float:
        return GPU(t, 0)

    assert slo_tree_budget(15.0, 2.0, 0.0, decode_ms, 64, 2048) == 96
    # Drafting time comes off what the forward may take.
    assert slo_tree_budget(15.0, 2.0, 5.0, decode_ms, 64, 2048) == 80
    # A tighter SLO gets fewer tokens, never fewer than the knee...
    assert slo_tree_budget(8.0, 2.0, 0.0, decode_ms, 64, 2048) == 64
    budgets = [slo_tree_budget(s, 2.0, 0.0, decode_ms, 64, 2048) for s in (10, 20, 40, 80)]
    assert budgets == sorted(budgets) and budgets[0] == 64 and budgets[-1] > budgets[1]
    # ... and a relaxed one no more than one forward carries.
    assert slo_tree_budget(1e6, 2.0, 0.0, decode_ms, 64, 512) == 512


def test_only_a_decoder_past_its_tpot_slo_counts_as_behind() -> None:
    # 30 tokens in 1.2 s at a 50 ms SLO: 40 ms per token, on track; 2 s: behind.
    assert not behind_tpot([dec(0, 50.0, 1200.0, 30), dec(1, 150.0, 2000.0, 30)])
    assert behind_tpot([dec(0, 50.0, 1200.0, 30), dec(1, 50.0, 2000.0, 30)])
    # Too few tokens for the ratio to mean anything: a slow first iteration is no debt.
    assert not behind_tpot([dec(0, 50.0, 400.0, 2)])
    assert not behind_tpot([])


def test_a_prompt_with_ttft_slack_waits_and_one_near_its_deadline_does_not() -> None:
    # 0.2 ms per prompt token: 1,000 queued tokens take 0.2 s, 0.6 s counted thrice.
    assert hold_prompt(3.0, 0.0, 1000, 0.2)  # summarization, 3 s away: waits
    assert not hold_prompt(1.0, 0.0, 1000, 0.2)  # 1 s away: 0.5 + 0.6 s needed, admitted
    assert hold_prompt(1.0, 0.0, 100, 0.2)  # a short prompt may wait a little
    assert not hold_prompt(0.5, 0.0, 100, 0.2)
    assert not hold_prompt(1.0, 2.0, 10, 0.2)  # deadline passed: nothing left to spend
    # A longer queue ahead shortens the wait.
    waits = [hold_prompt(2.0, 0.0, q, 0.2) for q in (100, 1000, 2000, 4000)]
    assert waits == [True, True, True, False]


def test_the_knee_prior_at_budget_one_is_a_valid_curve() -> None:
    # (1, 1, 2) repeated a token count and raised: `adaserve generate --budget 1` died.
    curve = Curve.knee(20.0, 1)
    assert curve.tokens == (1.0, 2.0)
    assert curve(1, 0) == 20.0 and curve(4, 0) == 80.0


def test_trees_yield_forward_tokens_to_ttft_deadlines_under_yield_tokens() -> None:
    """A large tree budget (policy adaserve's SLO-sized one) fills max_batch_tokens; a
    prompt due soon needs more than the cap leaves. Without `yield_tokens` it gets the
    leftover (and the plan says it is short); with it, the throughput trees give up
    tokens of the cap (not below the SLO trees) so the chunk grows."""
    flat = Curve.knee(20.0, 4096)  # time never binds: only the token cap does
    limits = BatchLimits(
        tree_budget=480, max_batch_tokens=512, min_prefill_tokens=8, depth=3, acceptance=0.8
    )
    decoders = [dec(i, slo=1000.0) for i in range(120)]
    prompt = [pre(0, 2000, deadline=100.0)]  # due in ~5 iterations: needs ~400 a step
    before = form_batch(decoders, prompt, limits, flat)
    assert before.tree_budget == 480 and before.prefill_tokens == 32 and before.ttft_short
    after = form_batch(
        decoders, prompt, BatchLimits(**{**limits.__dict__, "yield_tokens": True}), flat
    )
    assert after.tree_budget >= after.slo_tree_tokens
    assert after.prefill_tokens > 300 and after.tree_budget + after.prefill_tokens <= 512


def test_a_prompt_without_a_ttft_slo_rides_only_in_the_decoders_slack() -> None:
    """`slo_prefill` (policy adaserve): no SLO waits on the first token of a prompt without
    a TTFT SLO, so its prefill takes only what keeps every decoding request on its TPOT
    SLO, t_r (o_r + E) - l_r; with slack to spare the whole stretch still applies."""
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))  # 1 ms per token past the first
    limits = BatchLimits(64, 4096, 1, stretch=2.0, slo_prefill=True)
    relaxed = [dec(0, slo=1000.0)]
    free = form_batch(relaxed, [pre(0, 3000, binding=False)], limits, linear)
    assert free.time_limit_ms == pytest.approx(2.0 * linear(1, 0, 0.0))
    assert free.prefill_tokens == 10
    # 20 tokens in after 236 ms at 12 ms a token: 12 * 21 - 236 = 16 ms (no drafting: E
    # = 1), less than the stretch's 22.
    edge = dec(1, slo=12.0, elapsed=236.0, decoded=20)
    plan = form_batch([*relaxed, edge], [pre(0, 3000, binding=False)], limits, linear)
    assert linear(2, plan.prefill_tokens, 0.0) <= 16.0 < linear(2, plan.prefill_tokens + 1, 0.0)
    plain = form_batch([*relaxed, edge], [pre(0, 3000, binding=False)], LIMITS_2X, linear)
    assert plain.prefill_tokens > plan.prefill_tokens


def test_the_slack_counts_the_tokens_a_tree_is_expected_to_give() -> None:
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))
    limits = BatchLimits(64, 4096, 1, stretch=3.0, depth=2, acceptance=0.5, slo_prefill=True)
    # E = 1 + .5 + .25: 10 * (20 + 1.75) - 200 = 17.5 ms, where the bonus alone leaves 10.
    d = dec(0, slo=10.0, elapsed=200.0, decoded=20)
    plan = form_batch([d], [pre(0, 3000, binding=False)], limits, linear)
    trees = 1 + 2  # the root and a chain of 2
    assert (
        linear(trees, plan.prefill_tokens, 0.0)
        <= 17.5
        < linear(trees, plan.prefill_tokens + 1, 0.0)
    )


def test_a_decoder_behind_its_slo_leaves_a_prompt_without_a_ttft_slo_min_prefill() -> None:
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))
    limits = BatchLimits(64, 4096, 4, stretch=2.0, slo_prefill=True)
    behind = dec(0, slo=10.0, elapsed=500.0, decoded=20)  # 25 ms a token so far
    plan = form_batch([behind], [pre(0, 3000, binding=False)], limits, linear)
    assert plan.prefill_tokens == limits.min_prefill_tokens


def test_prompts_with_a_ttft_slo_go_first_and_keep_the_whole_stretch() -> None:
    """Under `slo_prefill` a prompt with a TTFT SLO is served before one without, whatever
    their deadlines (the one without has a default deadline, here already past), and
    takes the stretch a decoder behind its SLO would deny the other."""
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))
    limits = BatchLimits(64, 4096, 1, stretch=2.0, slo_prefill=True)
    behind = dec(0, slo=10.0, elapsed=500.0, decoded=20)
    ttft = pre(1, 3000, deadline=1e6)
    old = pre(0, 3000, deadline=-5.0, binding=False)
    plan = form_batch([behind], [old, ttft], limits, linear)
    assert [rid for rid, _ in plan.chunks] == ["p1"]
    whole = form_batch([behind], [ttft], LIMITS_2X, linear)
    assert plan.prefill_tokens == whole.prefill_tokens > limits.min_prefill_tokens
    # Without slo_prefill the older default deadline goes first.
    assert form_batch([behind], [old, ttft], LIMITS_2X, linear).chunks[0][0] == "p0"


def test_with_no_decoder_prompts_go_by_deadline_while_the_ttft_slos_hold() -> None:
    """`slo_prefill` in an iteration no request decodes in: no decoder's slack is at
    stake, so a short prompt without a TTFT SLO goes ahead of a long one with a distant
    deadline (deadline order, as continuous batching serves them), but not where that
    would cost the TTFT SLO its deadline at half this iteration's pace."""
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))  # ~1 ms a prompt token
    limits = BatchLimits(64, 512, 1, slo_prefill=True)
    short = pre(0, 300, deadline=10_000.0, binding=False)
    distant = pre(1, 6000, deadline=1e6)  # ~1,000 chunks' time away, 12 chunks of work
    plan = form_batch([], [distant, short], limits, linear)
    assert plan.chunks == (("p0", 300), ("p1", 212))
    # Due in ~5 chunks' time at half the pace: 6,300 tokens over 5 > 512 a chunk.
    close = pre(1, 6000, deadline=6_000.0)
    assert form_batch([], [close, short], limits, linear).chunks == (("p1", 512),)
    # With a decoder, the prompt with the TTFT SLO still goes first (its stretch).
    assert form_batch([dec(0, slo=1000.0)], [distant, short], limits, linear).chunks[0][0] == "p1"
    # A preempted request's recompute (its TPOT SLO waits on it) goes ahead of both,
    # even with a later deadline than the short prompt's default one.
    resumed = pre(2, 100, deadline=20_000.0, binding=False, resumed=True)
    plan = form_batch([], [distant, short, resumed], limits, linear)
    assert plan.chunks == (("p2", 100), ("p0", 300), ("p1", 112))


def test_a_preempted_requests_recompute_is_waited_on_like_a_ttft_slo() -> None:
    """A preempted request has no TTFT deadline left, but its TPOT SLO (counted from a
    first token it already has) waits on its recompute: under `slo_prefill` it goes
    ahead of prompts without a TTFT SLO and keeps the stretch."""
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))
    limits = BatchLimits(64, 4096, 1, stretch=2.0, slo_prefill=True)
    behind = dec(0, slo=10.0, elapsed=500.0, decoded=20)
    fresh = pre(0, 3000, deadline=-10.0, binding=False)
    resumed = pre(1, 3000, deadline=-5.0, binding=False, resumed=True)
    plan = form_batch([behind], [fresh, resumed], limits, linear)
    assert plan.chunks[0][0] == "p1"
    assert plan.prefill_tokens == form_batch([behind], [resumed], LIMITS_2X, linear).prefill_tokens
    assert plan.prefill_tokens > limits.min_prefill_tokens


def test_a_best_effort_decoder_leaves_the_stretch_to_prompts_without_a_ttft_slo() -> None:
    linear = Curve((1.0, 1000.0), (10.0, 1009.0))
    limits = BatchLimits(64, 4096, 1, stretch=2.0, slo_prefill=True)
    hopeless = Decoding("d0", 10.0, 500.0, 20, best_effort=True)  # 25 ms a token
    plan = form_batch([hopeless], [pre(0, 3000, binding=False)], limits, linear)
    assert (
        plan.prefill_tokens
        == form_batch([hopeless], [pre(0, 3000)], LIMITS_2X, linear).prefill_tokens
    )
    assert plan.prefill_tokens > limits.min_prefill_tokens
