"""SLO-aware routing (adaserve/routing.py) as a pure function, and the prefix keys and
their replicated LRU."""

from __future__ import annotations

import random

import pytest

from adaserve.routing import (
    MAX_KEYS,
    Candidate,
    PrefixLog,
    PrefixMirror,
    RouteRequest,
    RoutingParams,
    UnitLoad,
    imbalance,
    match_depth,
    message_keys,
    route,
    text_keys,
    token_keys,
)

# TPOT 20 ms alone, +10 ms per request: a request at batch n waits 10 (n + 1) ms a token.
CURVE = tuple((n, 10.0 * (n + 1)) for n in (1, 2, 4, 8, 16))


def load(running: int = 0, tightest: float = 0.0, **kw: object) -> UnitLoad:
    fields: dict = dict(
        running=running,
        waiting=0,
        max_running=16,
        kv_usage=0.1,
        tpot_curve=CURVE,
        tightest_slo_ms=tightest,
        prefill_queue_tokens=0,
        prefill_ms_per_token=0.1,
    )
    fields.update(kw)
    return UnitLoad(**fields)


def cand(ld: UnitLoad | None, age: float = 0.0, out: int = 0, **kw: object) -> Candidate:
    return Candidate(outstanding=out, load=ld, load_age_s=age, tpot_slo_ms=100.0, **kw)


SLO = RoutingParams()


def test_tpot_curve_interpolates_and_extrapolates() -> None:
    ld = load()
    assert ld.tpot_ms(1) == 20.0 and ld.tpot_ms(3) == 40.0 and ld.tpot_ms(32) == 330.0
    assert load(tpot_curve=()).tpot_ms(1) == float("inf")


def test_a_tight_request_goes_where_its_slo_holds() -> None:
    # Unit 0 runs 6 (batch 7 -> 80 ms), unit 1 runs 2 (batch 3 -> 40 ms).
    cands = [cand(load(6)), cand(load(2))]
    tight = [Candidate(0, c.load, 0.0, tpot_slo_ms=50.0) for c in cands]
    assert route(RouteRequest(), tight, SLO) == ((1,), "slo")


def test_slo_and_prefix_choose_only_among_nearly_balanced_units() -> None:
    # Unit 1 holds the prefix and meets the SLO, but runs 4 more than unit 0 (> 2).
    cands = [cand(load(1)), cand(load(5), prefix_match=3)]
    assert route(RouteRequest(), cands, SLO) == ((0,), "slo")
    # Near the least loaded, feasibility decides: unit 0 (batch 3) would break its
    # 35 ms request; unit 1 (batch 5, within 2) breaks nothing.
    cands = [cand(load(2, tightest=35.0)), cand(load(4))]
    assert route(RouteRequest(), cands, SLO) == ((1,), "slo")
    assert imbalance(0) == 2 and imbalance(40) == 10


def test_the_units_tightest_running_request_is_protected() -> None:
    # Both meet the new request's 100 ms; unit 1 holds a 45 ms request that batch 4
    # (50 ms) would break, unit 0 only relaxed ones: unit 0 though it runs more.
    cands = [cand(load(5, tightest=100.0)), cand(load(3, tightest=45.0))]
    assert route(RouteRequest(), cands, SLO) == ((0,), "slo")


def test_among_feasible_units_the_smallest_batch_then_the_most_headroom() -> None:
    cands = [cand(load(4)), cand(load(1)), cand(load(1))]
    assert route(RouteRequest(), cands, SLO) == ((1, 2), "slo")
    # Equal batches: the unit whose tightest request leaves more room.
    cands = [cand(load(2, tightest=60.0)), cand(load(2))]
    assert route(RouteRequest(), cands, SLO) == ((1,), "slo")
    # A unit predicted a little faster does not take everything (no herding on noise).
    fast = load(3, tpot_curve=tuple((n, 0.9 * ms) for n, ms in CURVE))
    assert route(RouteRequest(), [cand(fast), cand(load(1))], SLO).choices == (1,)


def test_requests_sent_since_the_report_count_against_the_unit() -> None:
    # Without it, a burst between two reports would all go to the emptiest unit.
    cands = [cand(load(2)), cand(load(0), sent_since_report=4)]
    assert route(RouteRequest(), cands, SLO).choices == (0,)


def test_a_unit_holding_the_prefix_wins_when_its_slo_allows() -> None:
    cands = [cand(load(1)), cand(load(3), prefix_match=3), cand(load(3), prefix_match=1)]
    assert route(RouteRequest(), cands, SLO) == ((1,), "prefix")
    # ... but not at the cost of the SLO: batch 13 there would take 140 ms.
    cands = [cand(load(1)), cand(load(12), prefix_match=3)]
    assert route(RouteRequest(), cands, SLO) == ((0,), "slo")


def test_full_kv_and_full_batches_are_not_feasible() -> None:
    assert route(RouteRequest(), [cand(load(0, kv_usage=0.97)), cand(load(3))], SLO).choices == (1,)
    full = load(3, max_running=4, waiting=1)  # batch 5 > max_running 4: it would queue
    assert route(RouteRequest(), [cand(full), cand(load(5))], SLO).choices == (1,)


def test_ttft_slo_weighs_the_prefill_queue() -> None:
    # 2000 queued prompt tokens at 0.1 ms: 200 ms before this one's prefill starts.
    queued = load(0, prefill_queue_tokens=2000)
    cands = [cand(queued), cand(load(5))]
    assert route(RouteRequest(ttft_slo_ms=150.0, prompt_tokens=100), cands, SLO).choices == (1,)
    assert route(RouteRequest(), cands, SLO).choices == (0,)  # no TTFT SLO: headroom
    # A TTFT SLO the unit resolves from the request's class counts the same.
    by_class = [cand(queued, ttft_slo_ms=150.0), cand(load(5))]
    assert route(RouteRequest(prompt_tokens=100), by_class, SLO).choices == (1,)


def test_with_no_feasible_unit_the_least_bad_one() -> None:
    cands = [cand(load(14)), cand(load(12))]
    assert route(RouteRequest(), cands, SLO) == ((1,), "overloaded")


def test_stale_reports_are_not_trusted() -> None:
    # Unit 1's last report says idle, but it is 5 s old (a hung or dead unit): nothing
    # goes there while unit 0 reports fresh, however loaded unit 0 is.
    cands = [cand(load(14), out=14), cand(load(0), age=5.0, out=0)]
    assert route(RouteRequest(), cands, SLO).choices == (0,)
    # With no fresh report anywhere: least outstanding requests.
    cands = [cand(load(0), age=5.0, out=3), cand(None, out=1), cand(load(0), age=9.0, out=1)]
    assert route(RouteRequest(), cands, SLO) == ((1, 2), "stale")


def test_draining_units_get_nothing() -> None:
    cands = [cand(load(0, draining=True)), cand(load(14))]
    assert route(RouteRequest(), cands, SLO).choices == (1,)
    lo = RoutingParams(policy="least_outstanding")
    cands = [cand(load(0, draining=True), out=0), cand(load(14), out=9)]
    assert route(RouteRequest(), cands, lo) == ((1,), "least_outstanding")


def test_least_outstanding_policy_ignores_the_reports() -> None:
    lo = RoutingParams(policy="least_outstanding")
    cands = [cand(load(0), out=2), cand(load(14), out=1)]
    assert route(RouteRequest(), cands, lo).choices == (1,)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        route(RouteRequest(), [], SLO)
    with pytest.raises(ValueError, match="routing policy"):
        route(RouteRequest(), [cand(load())], RoutingParams(policy="random"))


def test_pressure_says_when_a_unit_cannot_take_more() -> None:
    assert load(0).pressure == 0.0  # idle
    assert load(3, tightest=50.0).pressure == pytest.approx(50.0 / 50.0)  # batch 4: 50 ms
    assert load(8, tightest=50.0).pressure > 1.0


# ---- prefix keys ----------------------------------------------------------------------


def test_a_follow_up_turn_shares_the_previous_turns_keys() -> None:
    first = [("system", "be brief"), ("user", "hi")]
    second = [*first, ("assistant", "hello!"), ("user", "and then?")]
    a, b = message_keys(first), message_keys(second)
    assert len(a) == 2 and len(b) == 4 and b[:2] == a
    assert message_keys([("user", "hi")])[0] != message_keys([("system", "hi")])[0]
    # A chain: the same message after a different history has a different key.
    assert message_keys([("user", "x"), ("user", "hi")])[1] != a[1]
    held = PrefixMirror(8)
    held.touch(a)
    assert match_depth(b, held) == 2 and match_depth(message_keys([("user", "x")]), held) == 0


def test_text_and_token_keys_cover_full_blocks_only() -> None:
    assert text_keys("a" * 255) == () and len(text_keys("a" * 600)) == 2
    assert text_keys("a" * 512 + "b") == text_keys("a" * 512 + "c")
    assert len(token_keys(list(range(200)))) == 3
    assert token_keys(list(range(128))) != token_keys(list(range(1, 129)))
    assert len(token_keys(list(range(100_000)))) == MAX_KEYS  # bounded per request
    assert text_keys("a" * 512)[0] != token_keys([97] * 64)[0]


def test_a_mirror_replaying_the_log_equals_the_units_lru() -> None:
    rng = random.Random(0)
    log = PrefixLog(16)
    mirrors = [PrefixMirror(16) for _ in range(3)]
    cursors: list[int | None] = [None, None, None]
    for step in range(400):
        log.touch(rng.randrange(40) for _ in range(rng.randrange(4)))
        # Readers poll at different rates; reader 2 falls far behind now and then.
        for i, m in enumerate(mirrors):
            if step % (1 + 2 * i) == 0 or (i == 2 and step % 97 == 0):
                keys, reset, cursors[i] = log.since(cursors[i])
                if reset:
                    m.clear()
                m.touch(keys)
                assert m.keys() == log.keys(), (step, i)


def test_a_reader_behind_the_log_gets_the_whole_set() -> None:
    log = PrefixLog(2)
    log.touch([1, 2])
    keys, reset, cursor = log.since(None)
    assert (keys, reset) == ([1, 2], True)
    assert log.since(cursor) == ([], False, cursor)
    log.touch([3, 4, 5, 6, 7])  # more than the log keeps (2 x capacity)
    keys, reset, _ = log.since(cursor)
    assert (keys, reset) == ([6, 7], True)
    with pytest.raises(ValueError):
        PrefixMirror(0)
