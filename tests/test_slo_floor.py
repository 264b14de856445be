"""The SLO floor (adaptive.slo_floor): the best TPOT one request alone can expect, from
the engine's own cost model, and admission's verdict on an SLO (slo.judge)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaserve.adaptive import slo_floor
from adaserve.config import AdaptiveSettings, load_settings
from adaserve.slo import judge
from tests._serving import REPO


def brute_force(t_plain: float, budget: int, s: AdaptiveSettings, depth_max: int) -> float:
    """Spelled out: iteration time of a d-deep chain for one request (verify of 1 + d
    tokens plus d draft steps, in verify-token units of t_plain / (B + 1)), over the
    expected tokens it emits, the bonus token counting 1."""
    best = float("inf")
    for d in range(depth_max + 1):
        draft = 0.0  # no cost model: draft steps count as free
        if s.draft_cost_tokens is not None:
            draft = s.draft_cost_tokens + s.draft_cost_tokens_per_request
        units = budget + 1 + d + d * draft
        expected = sum(s.acceptance**j for j in range(d + 1))
        best = min(best, t_plain * units / (budget + 1) / expected)
    return best


def test_embedded_cpu_settings_worked_example() -> None:
    s = load_settings(REPO / "configs" / "embedded-cpu.yaml").scheduler.adaptive
    floor = slo_floor(20.0, 16, s, s.d_max)
    # d = 2: 20 * (17 + 2 * (1 + 1.3 + 2.2)) / 17 / (1 + 0.6 + 0.36) = 15.61 ms; d = 1
    # gives 15.81 and d = 3 16.49. The old floor, 20 / (6 + 1), said 2.86 ms.
    assert floor.depth == 2
    assert floor.tpot_ms == pytest.approx(20.0 * 26.0 / 17.0 / 1.96)


def test_no_drafter_means_plain_decoding() -> None:
    s = AdaptiveSettings(acceptance=0.9)
    assert slo_floor(33.0, 16, s, 0).tpot_ms == 33.0
    assert slo_floor(33.0, 16, s, 0).depth == 0


def test_a_drafter_that_never_pays_leaves_plain_decoding() -> None:
    s = AdaptiveSettings(acceptance=0.05, draft_cost_tokens=8.0)
    floor = slo_floor(40.0, 16, s, 8)
    assert (floor.tpot_ms, floor.depth) == (40.0, 0)


@given(
    t_plain=st.floats(1.0, 500.0),
    budget=st.integers(1, 256),
    acceptance=st.floats(0.01, 0.99),
    cost=st.one_of(st.none(), st.floats(0.0, 20.0)),
    per_request=st.floats(0.0, 5.0),
    depth_max=st.integers(0, 12),
)
def test_floor_is_the_minimum_over_depths_and_between_the_old_bounds(
    t_plain: float,
    budget: int,
    acceptance: float,
    cost: float | None,
    per_request: float,
    depth_max: int,
) -> None:
    s = AdaptiveSettings(
        acceptance=acceptance,
        draft_cost_tokens=cost if cost is None else max(cost, 1e-3),
        draft_cost_tokens_per_request=per_request,
    )
    floor = slo_floor(t_plain, budget, s, depth_max)
    assert floor.tpot_ms == pytest.approx(brute_force(t_plain, budget, s, depth_max))
    assert 0 <= floor.depth <= depth_max
    assert floor.tpot_ms <= t_plain * (1 + 1e-12)  # plain decoding is always a candidate
    # The old floor assumed every draft token accepted and every step free: a bound
    # below, never above, the honest one.
    assert floor.tpot_ms >= t_plain / (depth_max + 1) * (1 - 1e-12)


def test_better_acceptance_and_cheaper_drafts_lower_the_floor() -> None:
    floors = [
        slo_floor(30.0, 16, AdaptiveSettings(acceptance=a, draft_cost_tokens=1.3), 6).tpot_ms
        for a in (0.3, 0.5, 0.7, 0.9)
    ]
    assert floors == sorted(floors, reverse=True) and floors[0] > floors[-1]
    costs = [
        slo_floor(30.0, 16, AdaptiveSettings(acceptance=0.7, draft_cost_tokens=c), 6).tpot_ms
        for c in (0.5, 2.0, 8.0)
    ]
    assert costs == sorted(costs) and costs[0] < costs[-1]


def test_judge_flags_only_slos_below_the_floor_and_says_why() -> None:
    ok = judge(20.0, 15.6, 2)
    assert not ok.best_effort and ok.floor_ms == 15.6 and ok.reason is None
    assert not judge(15.6, 15.6, 2).best_effort  # exactly the floor can be met
    low = judge(5.0, 15.6, 2)
    assert low.best_effort and low.floor_ms == 15.6
    assert "15.6 ms" in low.reason and "draft depth 2" in low.reason
    assert "plain decoding" in judge(5.0, 15.6, 0).reason
