"""Adaptive depth/width (paper 001 and 000 eq. 8-9) and the in-process scheduler."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaserve.adaptive import (
    TIGHT_LEVEL,
    AcceptanceEstimate,
    budget_bound_depth,
    plan_depth_width,
    slack_plan,
)
from adaserve.config import AdaptiveSettings, SchedulerSettings
from adaserve.scheduler import LocalScheduler, Scheduler, selection_params
from adaserve.selection import SelectionParams, select
from tests._selection import FIG2_PARAMS, FIG2_R0, FIG2_R1, FIG2_REQUESTS


def test_eurosys_policy_examples():
    s = AdaptiveSettings(policy="eurosys", d_min=1, d_max=8, w_max=4)
    assert plan_depth_width(1, 16, s) == (8, 4)  # floor(16/1) - 1 = 15 -> 8; 16 -> 4
    assert plan_depth_width(4, 16, s) == (3, 4)  # floor(16/4) - 1 = 3; floor(16/4) = 4
    assert plan_depth_width(8, 16, s) == (1, 2)
    assert plan_depth_width(32, 16, s) == (1, 1)  # clipped from below
    c = AdaptiveSettings(policy="eurosys", d_max=8, w_max=8, b1=64, b2=32, c1=2, c2=1)
    assert plan_depth_width(6, 16, c) == (7, 6)  # floor(64/8) - 1; floor(32/6) + 1


def test_v1_policy_examples():
    s = AdaptiveSettings(policy="v1", d_max=8, w_max=4)
    assert plan_depth_width(1, 16, s) == (8, 4)
    assert plan_depth_width(5, 16, s) == (4, 3)  # ceil(16/5), floor(16/5)
    assert plan_depth_width(32, 16, s) == (1, 1)


def test_fixed_policy_and_no_requests():
    s = AdaptiveSettings(policy="fixed", fixed_depth=5, fixed_width=2)
    assert plan_depth_width(0, 16, s) == plan_depth_width(100, 16, s) == (5, 2)
    for policy in ("eurosys", "v1"):
        a = AdaptiveSettings(policy=policy)
        assert plan_depth_width(0, 16, a) == plan_depth_width(1, 16, a)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n:"):
        plan_depth_width(-1, 16, AdaptiveSettings())
    with pytest.raises(ValueError, match="budget"):
        plan_depth_width(1, 0, AdaptiveSettings())


@given(
    n=st.integers(0, 600),
    budget=st.integers(1, 2048),
    d_min=st.integers(0, 4),
    d_max=st.integers(1, 16),
    w_max=st.integers(1, 16),
    c1=st.integers(-3, 8),
    c2=st.integers(-3, 3),
)
def test_eurosys_formula_and_bounds(n, budget, d_min, d_max, w_max, c1, c2):
    s = AdaptiveSettings(policy="eurosys", d_min=d_min, d_max=d_max, w_max=w_max, c1=c1, c2=c2)
    d, w = plan_depth_width(n, budget, s)
    m = max(n, 1)
    hi = max(d_min, d_max)
    if m + c1 > 0:
        assert d == min(hi, max(d_min, budget // (m + c1) - 1))
    assert d_min <= d <= hi
    assert w == min(w_max, max(1, budget // m + c2))


@given(n=st.integers(1, 600), budget=st.integers(1, 2048))
def test_v1_formula(n, budget):
    s = AdaptiveSettings(policy="v1", d_max=8, w_max=4)
    assert plan_depth_width(n, budget, s) == (
        max(1, min(8, math.ceil(budget / n))),
        max(1, min(4, budget // n)),
    )


def test_local_scheduler_plans_and_selects():
    settings = SchedulerSettings(budget=8, adaptive=AdaptiveSettings(policy="v1", d_max=3, w_max=2))
    scheduler: Scheduler = LocalScheduler(settings)
    assert scheduler.plan(2) == (3, 2)
    trees = [FIG2_R0, FIG2_R1]
    got = scheduler.select(FIG2_REQUESTS, trees, FIG2_PARAMS)
    assert [s.tolist() for s in got.selected] == [[0, 1, 3, 5], [0, 1, 2, 3]]


def test_selection_params_follow_the_settings():
    s = SchedulerSettings(
        budget=32, policy="equal", order="ascending_a", n_max=4, correction_factor=1.05
    )
    p = selection_params(s, depth=5, t_spec_ms=20.0)
    assert p.t_spec_ms == pytest.approx(21.0)
    assert p == SelectionParams(32, 5, p.t_spec_ms, "equal", 4, "ascending_a")
    # The inflated t_spec raises A(r) by t_spec * 0.05 / tpot for every request.
    params = selection_params(SchedulerSettings(budget=8), 3, 10.0)
    fig2 = select(FIG2_REQUESTS, [FIG2_R0, FIG2_R1], params)
    assert fig2.a == pytest.approx([1.6 + 0.05, 1.8 + 0.05])


def test_cost_cap_is_off_by_default():
    s = AdaptiveSettings(d_max=6, w_max=1, c1=-8)
    assert s.draft_cost_tokens is None
    assert plan_depth_width(10, 128, s) == (6, 1)


def test_cost_cap_picks_the_depth_with_most_tokens_per_unit_time():
    s = AdaptiveSettings(d_max=6, w_max=1, c1=-8, draft_cost_tokens=20.0, acceptance=0.75)
    for n in (1, 5, 10, 20, 30, 60):
        eq8, _ = plan_depth_width(n, 128, s.model_copy(update={"draft_cost_tokens": None}))

        def rate(d: int, n: int = n) -> float:
            return n * sum(0.75**j for j in range(d + 1)) / (128 + n * (d + 1) + 20.0 * d)

        best = max(range(1, 7), key=rate)
        assert plan_depth_width(n, 128, s)[0] == min(eq8, best)
    # Light load no longer drafts six steps; heavier load drafts fewer than light load.
    assert plan_depth_width(10, 128, s)[0] < 6
    assert plan_depth_width(40, 128, s)[0] <= plan_depth_width(5, 128, s)[0]


def test_prefill_riding_along_is_a_fixed_cost_that_deepens_the_chain():
    """Prompt tokens in the iteration cost the decoders the same at any depth: with them
    in the denominator, a deeper chain pays (the CPU profile's settings in the simulator:
    2 decoders, a 5.2-token draft step, 19 prompt tokens an iteration)."""
    s = AdaptiveSettings(d_min=1, d_max=6, w_max=2, draft_cost_tokens=5.2, acceptance=0.75)

    def rate(d: int, p: int) -> float:
        return 2 * sum(0.75**j for j in range(d + 1)) / (16 + p + 2 * (d + 1) + 5.2 * d)

    for p in (0, 8, 19, 64, 400):
        best = max(range(1, 7), key=lambda d, p=p: rate(d, p))
        assert plan_depth_width(2, 16, s, prefill_tokens=p)[0] == best  # (eq. 8 plans 6)
    assert plan_depth_width(2, 16, s)[0] == plan_depth_width(2, 16, s, prefill_tokens=0)[0]
    assert plan_depth_width(2, 16, s, prefill_tokens=19)[0] > plan_depth_width(2, 16, s)[0]
    depths = [plan_depth_width(2, 16, s, prefill_tokens=p)[0] for p in range(0, 400, 7)]
    assert depths == sorted(depths)  # more prefill never plans a shallower chain
    # The eq. 8 depth still bounds it, and without a cost model prefill changes nothing.
    assert plan_depth_width(40, 128, s, prefill_tokens=10_000)[0] == 128 // 40 - 1
    free = s.model_copy(update={"draft_cost_tokens": None})
    assert plan_depth_width(2, 16, free, prefill_tokens=50) == plan_depth_width(2, 16, free)


def test_cost_cap_keeps_d_min_and_leaves_fixed_alone():
    s = AdaptiveSettings(d_min=3, d_max=6, draft_cost_tokens=1000.0)
    assert plan_depth_width(50, 128, s)[0] == 3
    fixed = AdaptiveSettings(policy="fixed", fixed_depth=5, draft_cost_tokens=1000.0)
    assert plan_depth_width(50, 128, fixed) == (5, 1)


def test_d_min_zero_switches_speculation_off_where_it_does_not_pay():
    """d_min 0 makes plain decoding a candidate of the cost cap: the CPU settings keep
    drafting for one request and stop for a batch whose per-request draft work costs
    more than the tokens it adds (vLLM's disable-by-batch-size, from the cost model)."""
    s = AdaptiveSettings(
        d_min=0,
        d_max=4,
        w_max=2,
        draft_cost_tokens=0.8,
        draft_cost_tokens_per_request=0.46,
        acceptance=0.45,
    )

    def rate(d: int, n: int) -> float:
        step = 0.8 + 0.46 * n
        return n * sum(0.45**j for j in range(d + 1)) / (16 + n * (d + 1) + d * step)

    for n in range(1, 17):
        eq8, _ = plan_depth_width(n, 16, s.model_copy(update={"draft_cost_tokens": None}))
        assert plan_depth_width(n, 16, s)[0] == min(eq8, max(range(0, 5), key=lambda d: rate(d, n)))
    assert plan_depth_width(1, 16, s)[0] == 2
    assert plan_depth_width(8, 16, s)[0] == 0
    # Without the per-request term the same batch still drafts one step.
    flat = s.model_copy(update={"draft_cost_tokens_per_request": 0.0})
    assert plan_depth_width(8, 16, flat)[0] == 1
    # d_min 1 (the default) never switches off.
    assert plan_depth_width(8, 16, s.model_copy(update={"d_min": 1}))[0] == 1


def _kept_tokens_rate(n: int, d: int, budget: int, s: AdaptiveSettings) -> float:
    """Tokens per unit of iteration time, counted token by token: every request's
    level-j draft token is accepted with probability alpha^j, selection keeps the
    budget's B - n most likely, and each kept token costs one unit."""
    assert s.draft_cost_tokens is not None
    drafted = sorted((s.acceptance**j for _ in range(n) for j in range(1, d + 1)), reverse=True)
    kept = drafted[: max(budget - n, 0)]
    step = s.draft_cost_tokens + s.draft_cost_tokens_per_request * n
    return (n + sum(kept)) / (budget + n + len(kept) + d * step)


@pytest.mark.parametrize("per_request", [0.0, 0.5])
@pytest.mark.parametrize("acceptance", [0.45, 0.75, 0.9])
def test_where_the_budget_truncates_the_trees_the_depth_counts_the_tokens_it_keeps(
    per_request: float, acceptance: float
) -> None:
    """The CPU profile's knee budget of 4 in the simulator (a draft step of 1.84 tokens):
    three decoding requests drafted one step deep give the verifier three tokens, of
    which the budget keeps one. The depth is the one with the most tokens per unit of
    time counted token by token, depth 0 (plain decoding) included whatever d_min."""
    s = AdaptiveSettings(
        d_min=1,
        d_max=6,
        w_max=2,
        draft_cost_tokens=1.84,
        draft_cost_tokens_per_request=per_request,
        acceptance=acceptance,
    )
    for budget in (4, 8, 16):
        for n in range(budget // 2 + 1, budget + 3):
            best = max(range(7), key=lambda d, n=n: _kept_tokens_rate(n, d, budget, s))
            assert budget_bound_depth(n, budget, s) == best
            assert plan_depth_width(n, budget, s, decoding=n)[0] == min(
                best,
                plan_depth_width(n, budget, s.model_copy(update={"draft_cost_tokens": None}))[0],
            )
    if acceptance == 0.75 and per_request == 0.0:
        assert plan_depth_width(3, 4, s, decoding=3)[0] == 0  # one kept token does not pay
        assert plan_depth_width(3, 4, s)[0] == 1  # (without the count: d_min)


def test_the_budgets_room_counts_only_where_it_truncates_the_trees() -> None:
    s = AdaptiveSettings(d_min=1, d_max=6, w_max=2, draft_cost_tokens=1.84, acceptance=0.75)
    # Up to B / 2 decoding requests, each can have a drafted token: the plan is as before,
    # for the n the planner counts (requests being prefilled included).
    for n, decoding in ((1, 1), (2, 2), (5, 2), (3, 1), (40, 64)):
        assert plan_depth_width(n, 4 if n < 40 else 128, s, decoding=decoding) == (
            plan_depth_width(n, 4 if n < 40 else 128, s)
        )
    # Without a cost model there is nothing to count against.
    free = s.model_copy(update={"draft_cost_tokens": None})
    assert plan_depth_width(3, 4, free, decoding=3) == plan_depth_width(3, 4, free)
    with pytest.raises(ValueError, match="cost model"):
        budget_bound_depth(3, 4, free)


def test_eurosys_with_d_min_zero_stops_drafting_past_half_the_budget():
    s = AdaptiveSettings(d_min=0, d_max=8, w_max=4)
    assert plan_depth_width(8, 16, s)[0] == 1  # floor(16/8) - 1
    assert plan_depth_width(9, 16, s)[0] == 0  # floor(16/9) - 1: every token is a root


CPU = AdaptiveSettings(
    d_min=0,
    d_max=4,
    w_max=2,
    draft_cost_tokens=1.3,
    draft_cost_tokens_per_request=2.2,
    acceptance=0.6,
)


def test_slack_plan_drafts_the_tight_level_at_the_fastest_depth_the_slack_pays_for():
    """Two coding requests (1.2x a 200 ms baseline) among four chat ones (2x): plain
    decoding is the cost cap's plan for six, but the chat requests' slack buys the
    coding ones a tree; the depth is the one with the lowest tight TPOT that keeps the
    stretched iteration within the margin of the chat SLO."""
    slo = np.array([240.0, 400.0, 240.0, 400.0, 400.0, 400.0])
    assert plan_depth_width(6, 16, CPU)[0] == 0
    tight, depth = slack_plan(slo, 180.0, 16, CPU)
    assert tight.tolist() == [True, False, True, False, False, False]

    def tpots(d: int) -> tuple[float, float]:  # (drafted, undrafted) relative to plain
        stretch = (16 + 6 + 2 * d + d * (1.3 + 2.2 * 2)) / (16 + 6)
        return stretch / sum(0.6**j for j in range(d + 1)), stretch

    ok = [d for d in range(1, 5) if tpots(d)[0] < 1 and 180 * tpots(d)[1] <= 0.8 * 400]
    assert ok and depth == min(ok, key=lambda d: tpots(d)[0])
    # The relaxed requests pay: a slower iteration, still within the margin of their SLO.
    assert 180.0 * tpots(depth)[1] <= 0.8 * 400.0 and tpots(depth)[0] < 1.0 < tpots(depth)[1]


def test_slack_plan_needs_slack_two_slo_levels_and_a_cost_model():
    mixed = np.array([240.0, 400.0, 400.0, 400.0])
    assert slack_plan(mixed, 180.0, 16, CPU)[1] > 0
    # One SLO level (within TIGHT_LEVEL of the tightest): nobody pays for anybody.
    same = np.array([240.0, 240.0 * TIGHT_LEVEL, 240.0, 240.0])
    assert slack_plan(same, 180.0, 16, CPU)[1] == 0
    # The stretched iteration would take the relaxed requests past the margin.
    assert slack_plan(mixed, 300.0, 16, CPU)[1] == 0
    # Switched off, or no cost model to plan with, or a batch of one.
    assert slack_plan(mixed, 180.0, 16, CPU.model_copy(update={"slack_margin": None}))[1] == 0
    assert slack_plan(mixed, 180.0, 16, CPU.model_copy(update={"draft_cost_tokens": None}))[1] == 0
    assert slack_plan(mixed[:1], 180.0, 16, CPU)[1] == 0
    # A drafter too dear for any depth to beat plain decoding for the tight request.
    dear = CPU.model_copy(update={"draft_cost_tokens": 40.0})
    assert slack_plan(mixed, 10.0, 16, dear)[1] == 0
    tight, _ = slack_plan(mixed, 180.0, 16, CPU)
    assert tight.tolist() == [True, False, False, False]


def test_acceptance_estimate_starts_at_the_prior_and_follows_the_runs():
    est = AcceptanceEstimate(0.6, weight=10.0)
    assert est.alpha == pytest.approx(0.6)
    # 30 verifications that each accepted 3 levels and then were rejected: alpha -> 3/4
    for _ in range(30):
        est.observe(3, rejected=True)
    assert est.alpha == pytest.approx((6 + 90) / (6 + 90 + 4 + 30))
    # runs that reach a leaf are censored: they raise alpha, never count a rejection
    before = est.rejected
    est.observe(4, rejected=False)
    assert est.rejected == before and est.alpha > (6 + 90) / (6 + 90 + 4 + 30)


def test_acceptance_estimate_stays_inside_the_open_interval():
    est = AcceptanceEstimate(0.9)
    for _ in range(200):  # a drafter that is always wrong
        est.observe(0, rejected=True)
    assert est.alpha == 0.05
    est = AcceptanceEstimate(0.3)
    for _ in range(200):  # one that is always right
        est.observe(4, rejected=False)
    assert est.alpha == 0.95


def test_without_evidence_the_estimate_returns_to_the_prior():
    """Plain decoding gathers no evidence; ticks fade the old evidence, so a drafter
    switched off by a bad stretch gets planned (and measured) again."""
    est = AcceptanceEstimate(0.6)
    for _ in range(50):
        est.observe(0, rejected=True)
        est.tick()
    low = est.alpha
    assert low < 0.1
    for _ in range(600):
        est.tick()
    assert est.alpha == pytest.approx(0.6, abs=0.05)


def test_negative_settings_are_rejected():
    with pytest.raises(ValueError):
        AdaptiveSettings(d_min=-1)
    with pytest.raises(ValueError):
        AdaptiveSettings(draft_cost_tokens=1.0, draft_cost_tokens_per_request=-0.1)
    with pytest.raises(ValueError):
        AdaptiveSettings(slack_margin=1.5)


def test_draft_stop_prob_lifts_the_cap_only_where_it_plans_two_steps_or_more():
    """With the drafter's confidence ending each tree, a cap of >= 2 steps gives way to
    the policy's depth; a cap of one step or none stands."""
    s = AdaptiveSettings(
        d_min=0,
        d_max=6,
        w_max=2,
        draft_cost_tokens=1.3,
        draft_cost_tokens_per_request=2.2,
        acceptance=0.6,
    )
    stop = s.model_copy(update={"draft_stop_prob": 0.25})
    seen = set()
    for n in range(1, 17):
        capped, width = plan_depth_width(n, 16, s)
        eq8, _ = plan_depth_width(n, 16, s.model_copy(update={"draft_cost_tokens": None}))
        depth, w = plan_depth_width(n, 16, stop)
        assert w == width
        assert depth == (eq8 if capped >= 2 else capped), n
        seen.add(capped)
    assert {0, 1, 2} <= seen  # every branch was taken
    assert plan_depth_width(1, 16, stop) == (6, 2)
    with pytest.raises(ValueError):
        AdaptiveSettings(draft_stop_prob=1.0)


def test_ngram_pays_weighs_its_host_time_against_the_tokens_it_adds() -> None:
    """Trees pay where they promise NGRAM_MARGIN more tokens per unit time than plain
    decoding. What the CPU measured at 8 requests (1.20 tokens for 0.44 draft tokens per
    verification, ~0.25 token-units of host time per request) does not pay, and did not
    in closed rounds (0.85x of plain: BENCHMARKS.md); at one request it does; a summary
    copying its source (2.5 tokens for 2 nodes) pays at 8 too. More host time never
    makes it pay where less did not."""
    from adaserve.adaptive import NGRAM_MARGIN, ngram_pays

    assert NGRAM_MARGIN >= 1.0
    assert not ngram_pays(8, 16, 1.20, 0.44, 0.25)
    assert not ngram_pays(8, 16, 1.20, 0.44, 0.0)  # even with free lookups
    assert ngram_pays(1, 16, 1.20, 0.44, 0.25)
    assert ngram_pays(8, 16, 2.5, 2.0, 0.25)
    # Candidates (chains of depth 1..4 at acceptance 0.8, before evidence): the best.
    d = np.arange(1, 5)
    assert ngram_pays(8, 16, (1 - 0.8 ** (d + 1)) / 0.2, d, 0.25)
    assert not ngram_pays(8, 16, (1 - 0.3 ** (d + 1)) / 0.7, d, 0.0)
    costs = np.linspace(0.0, 3.0, 31)
    verdicts = [ngram_pays(8, 16, 1.5, 0.5, h) for h in costs]
    assert verdicts == sorted(verdicts, reverse=True) and verdicts[0] and not verdicts[-1]
