"""The engine end to end in one process: real tiny models, real drafter, real selection.

The lossless invariant is checked against an independent reference (Hugging Face
transformers' forward, greedy, no cache) under mixed SLOs, staggered arrivals,
drafter failures and lost drafter state.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import pytest

from adaserve import fallback, metrics
from adaserve.engine import Engine, EngineFull, output
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.scheduler import LocalScheduler
from adaserve.speculate import BeamDrafter
from tests._engine import (
    LONG,
    PROMPTS,
    hf_greedy,
    make_engine,
    req,
    run_to_completion,
)
from tests._engine import random_drafter_dir as random_drafter_dir  # a module fixture
from tests._engine import target_dir as target_dir  # a module fixture


@pytest.mark.parametrize("drafter", ["self", "random", "none"])
def test_greedy_output_equals_target_under_mixed_slos(target_dir, random_drafter_dir, drafter):
    drafter_dir = {"self": target_dir, "random": random_drafter_dir, "none": None}[drafter]
    engine = make_engine(target_dir, drafter_dir)
    slos = [10.0, 50.0, 150.0, 1.0, 1000.0]
    lengths = [24, 9, 17, 30, 5]
    first = [engine.submit(req(i, PROMPTS[i], lengths[i], slos[i])) for i in range(3)]
    late: list = []

    def arrive(step: int) -> None:  # staggered arrivals join a running batch
        if step in (2, 5):
            i = 3 + len(late)
            late.append(engine.submit(req(i, PROMPTS[i], lengths[i], slos[i])))

    res = run_to_completion(engine, first, on_step=arrive)
    res_late = run_to_completion(engine, late)
    got = {**res["tokens"], **res_late["tokens"]}
    for i in range(5):
        assert got[f"r{i}"] == hf_greedy(target_dir, PROMPTS[i], lengths[i]), f"request r{i}"
    assert engine.target.kv_usage() == 0.0  # every request's KV released
    if drafter == "self":
        assert engine.stats().iterations < sum(lengths)  # speculation actually accepted tokens


@pytest.mark.parametrize("max_batch,min_prefill", [(3, 1), (10, 7), (40, 16), (512, 16)], ids=str)
def test_prefill_chunks_of_any_size_ride_with_trees_losslessly(target_dir, max_batch, min_prefill):
    """Long prompts arrive while others decode: they are prefilled in chunks (of 1-3
    tokens up to whole prompts) inside the same forwards as the running requests'
    trees, and the drafter takes the same chunks. Every output is the target's own."""
    engine = make_engine(
        target_dir,
        target_dir,
        engine={"max_batch_tokens": max_batch, "min_prefill_tokens": min_prefill},
    )
    seen: list[tuple[int, int]] = []  # (tree tokens, prefill tokens) of each forward
    forward = engine.target.forward

    def recording(trees, chunks):
        seen.append((sum(len(t.tree) for t in trees), sum(len(c.tokens) for c in chunks)))
        return forward(trees, chunks)

    engine.target.forward = recording
    slos = [20.0, 80.0, 1000.0, 5.0]
    first = [
        engine.submit(req(0, LONG[0], 30, slos[0])),
        engine.submit(req(1, PROMPTS[1], 40, 50.0)),
    ]
    late: list = []

    def arrive(step: int) -> None:
        if step in (4, 6, 9):
            i = 1 + len(late)
            late.append(engine.submit(req(10 + i, LONG[i], 12 + 3 * i, slos[i])))

    res = run_to_completion(engine, first, on_step=arrive)
    res_late = run_to_completion(engine, late)
    got = {**res["tokens"], **res_late["tokens"]}
    assert got["r0"] == hf_greedy(target_dir, LONG[0], 30)
    assert got["r1"] == hf_greedy(target_dir, PROMPTS[1], 40)
    for i in range(1, 4):
        assert got[f"r{10 + i}"] == hf_greedy(target_dir, LONG[i], 12 + 3 * i), i
    assert any(t and p for t, p in seen)  # prompts did ride with trees
    assert all(p <= max(max_batch, min_prefill) for _, p in seen)
    if max_batch < 20:
        assert max(p for _, p in seen) < len(LONG[0])  # and were split into chunks
    assert engine.target.kv_usage() == 0.0
    assert engine.drafter.inner.runner.kv_usage() == 0.0


class RecordingScheduler(LocalScheduler):
    """The real in-process scheduler, recording each call's policy and whether its
    selection was INVALID."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.calls: list[tuple[str, bool]] = []

    def select(self, requests, trees, params):
        got = super().select(requests, trees, params)
        self.calls.append((params.policy, got.invalid))
        return got


@pytest.mark.parametrize(("slo_ms", "invalid"), [(1e6, False), (0.5, True)])
def test_policy_optimal_runs_algorithm_1_and_falls_back_where_invalid(
    target_dir, slo_ms, invalid, caplog
):
    """`policy: optimal` reaches the scheduler as optimal (it used to become adaserve
    silently). An SLO no tree can meet makes Algorithm 1 INVALID every iteration: the
    engine then selects with adaserve, counts it and logs it once; output is unchanged."""
    engine = make_engine(target_dir, target_dir, scheduler={"policy": "optimal"})
    sched = engine.scheduler.inner = RecordingScheduler(engine.settings.scheduler)
    before = metrics.optimal_invalid_total._value.get()
    streams = [engine.submit(req(i, PROMPTS[i], 12, slo_ms)) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="adaserve.engine"):
        res = run_to_completion(engine, streams)
    for i in range(3):
        assert res["tokens"][f"r{i}"] == hf_greedy(target_dir, PROMPTS[i], 12), f"request r{i}"
    assert sched.calls
    assert all(policy == "optimal" for policy, _ in sched.calls)
    assert all(got == invalid for _, got in sched.calls)
    fell_back = metrics.optimal_invalid_total._value.get() - before
    assert fell_back == (len(sched.calls) if invalid else 0)
    logged = [r for r in caplog.records if "policy optimal" in r.getMessage()]
    assert len(logged) == (1 if invalid else 0)


class FlakyDrafter:
    """Fault injection around the real BeamDrafter: raises on calls 3, 6 and 9 and, once,
    loses every request's state as a restarted drafter would; healthy afterwards."""

    def __init__(self, inner: BeamDrafter) -> None:
        self.inner = inner
        self.calls = 0

    def speculate(self, updates, depth, width, stop_prob=0.0):
        self.calls += 1
        if self.calls % 3 == 0 and self.calls <= 9:
            raise ConnectionError("drafter down")
        if self.calls == 5:
            self.inner.release([u.id for u in updates])  # restart: all state gone
        return self.inner.speculate(updates, depth, width, stop_prob)

    def release(self, ids):
        self.inner.release(ids)


def test_drafter_failures_and_lost_state_keep_output_identical(target_dir, monkeypatch):
    engine = make_engine(target_dir, target_dir)
    flaky = engine.drafter.inner = FlakyDrafter(engine.drafter.inner)
    # The engine backs off 1 s after a failure; shorten it so the test sees recovery.
    monkeypatch.setattr(fallback, "RETRY_S", 0.0)
    before = metrics.fallbacks_total.labels("drafter")._value.get()
    resyncs = metrics.drafter_resyncs_total._value.get()
    streams = [engine.submit(req(i, PROMPTS[i], 20, 30.0)) for i in range(3)]
    res = run_to_completion(engine, streams)
    for i in range(3):
        assert res["tokens"][f"r{i}"] == hf_greedy(target_dir, PROMPTS[i], 20)
    assert metrics.fallbacks_total.labels("drafter")._value.get() > before
    assert metrics.drafter_resyncs_total._value.get() > resyncs
    assert flaky.calls > 10  # it recovered after the last failure ...
    assert engine.stats().drafter_healthy  # ... and the engine noticed


def test_a_failed_release_is_sent_again_and_the_draft_state_freed(target_dir, monkeypatch):
    """A release that times out (the drafter still holds the state) is kept and sent by
    a later flush: the drafter ends holding no sequence."""
    engine = make_engine(target_dir, target_dir)
    inner = engine.drafter.inner
    failures = []

    class TimingOut:
        def speculate(self, updates, depth, width, stop_prob=0.0):
            return inner.speculate(updates, depth, width, stop_prob)

        def release(self, ids):
            if not failures:
                failures.append(list(ids))
                raise TimeoutError("release timed out")
            inner.release(ids)

    engine.drafter.inner = TimingOut()
    monkeypatch.setattr(fallback, "RETRY_S", 0.0)
    res = run_to_completion(engine, [engine.submit(req(0, PROMPTS[0], 8, 1e6))])
    assert res["tokens"]["r0"] == hf_greedy(target_dir, PROMPTS[0], 8)
    assert failures == [["r0"]]
    engine.step()  # idle: flushes what is queued
    assert inner.stats().num_sequences == 0


# Plain decoding for any batch of two or more, a depth of a few for one.
CAPPED = {
    "d_min": 0,
    "d_max": 3,
    "w_max": 1,
    "acceptance": 0.9,
    "draft_cost_tokens": 0.1,
    "draft_cost_tokens_per_request": 8.0,
}


def record_speculate(engine: Engine) -> list[tuple[list[str], int]]:
    """Wraps the engine's drafter; returns (request ids, depth) of every speculate call
    that drafted (prompt chunks handed over for ingestion alone are left out)."""
    calls: list[tuple[list[str], int]] = []
    inner = engine.drafter.inner

    class Recording:
        def speculate(self, updates, depth, width, stop_prob=0.0):
            drafted = [u.id for u in updates if not u.ingest]
            if drafted:
                calls.append((drafted, depth))
            return inner.speculate(updates, depth, width, stop_prob)

        def release(self, ids):
            inner.release(ids)

    engine.drafter.inner = Recording()
    return calls


def test_plans_without_speculation_stay_lossless_and_the_drafter_catches_up(target_dir):
    """d_min 0: the plan drafts nothing while the batch is large and resumes once it
    shrinks; the drafter then catches up on every token committed meanwhile."""
    engine = make_engine(target_dir, target_dir, scheduler={"adaptive": CAPPED})
    assert engine.local_scheduler.plan(1)[0] > 0 and engine.local_scheduler.plan(2)[0] == 0
    calls = record_speculate(engine)
    lengths = [6, 12, 30]
    res = run_to_completion(
        engine, [engine.submit(req(i, PROMPTS[i], lengths[i], 50.0)) for i in range(3)]
    )
    for i in range(3):
        assert res["tokens"][f"r{i}"] == hf_greedy(target_dir, PROMPTS[i], lengths[i])
    sizes = [len(ids) for ids, _ in calls]
    assert sizes and set(sizes) == {1}  # drafted only once the batch was down to one
    assert engine.stats().iterations < 30  # and the last request then sped up


def test_the_plan_counts_requests_being_prefilled(target_dir):
    """A request being prefilled joins the decode batch in an iteration or two, so the
    running ones are planned for the grown batch: alone, a request is drafted for; with
    a prompt arriving beside it, it is not (CAPPED drafts for one request, none for two)."""
    for arrival in (False, True):
        engine = make_engine(target_dir, target_dir, scheduler={"adaptive": CAPPED})
        calls = record_speculate(engine)
        streams = [engine.submit(req(0, PROMPTS[0], 6, 1e6))]
        engine.step()  # r0's prompt
        if arrival:
            streams.append(engine.submit(req(1, PROMPTS[1], 6, 1e6)))
        engine.step()  # r0's first tree, and r1's prompt if it came
        assert calls == ([] if arrival else [(["r0"], calls[0][1])])
        res = run_to_completion(engine, streams)
        for i in range(len(streams)):
            assert res["tokens"][f"r{i}"] == hf_greedy(target_dir, PROMPTS[i], 6)


# With draft steps of 2 token-units: depth 0 at alpha 0.05, 1 at 0.3, 4 at 0.95.
LEARNING = {"d_min": 0, "d_max": 4, "w_max": 1, "acceptance": 0.3, "draft_cost_tokens": 2.0}


@pytest.mark.parametrize("learn", [True, False])
def test_a_drafter_better_than_the_prior_earns_deeper_trees(target_dir, learn):
    """Self-drafting accepts every level: with learn_acceptance the plan moves from the
    prior's depth 1 to d_max as the estimate rises; without it, it stays at 1."""
    adaptive = {**LEARNING, "learn_acceptance": learn}
    # The plan at the knee budget: a 10 s SLO would otherwise size the iteration (and
    # so the depth) by what it allows (scheduler.slo_budget), which is not under test.
    scheduler = {"adaptive": adaptive, "slo_budget": False}
    engine = make_engine(target_dir, target_dir, scheduler=scheduler)
    calls = record_speculate(engine)
    res = run_to_completion(engine, [engine.submit(req(0, PROMPTS[0], 60, 1e4))])
    assert res["tokens"]["r0"] == hf_greedy(target_dir, PROMPTS[0], 60)
    depths = [d for _, d in calls]
    assert depths[0] == 1
    if learn:
        assert depths[-1] == 4 and engine.acceptance.alpha > 0.8
    else:
        assert set(depths) == {1} and engine.acceptance is None


def test_a_drafter_worse_than_the_prior_is_switched_off(target_dir, random_drafter_dir):
    """A random drafter is almost never accepted: the learned estimate falls below what
    a draft step costs and the plan becomes plain decoding. Output stays the target's."""
    adaptive = {**LEARNING, "learn_acceptance": True}
    engine = make_engine(target_dir, random_drafter_dir, scheduler={"adaptive": adaptive})
    calls = record_speculate(engine)
    iterations = engine.stats().iterations
    res = run_to_completion(engine, [engine.submit(req(0, PROMPTS[0], 60, 1e4))])
    assert res["tokens"]["r0"] == hf_greedy(target_dir, PROMPTS[0], 60)
    depths = [d for _, d in calls]
    assert engine.acceptance.alpha < LEARNING["acceptance"]
    # a few depth-1 probes, then plain decoding for the rest of the request
    assert 0 < len(depths) < (engine.stats().iterations - iterations) / 2


def test_requests_behind_their_slo_get_trees_when_the_batch_does_not(target_dir):
    """The cost cap plans no drafting for a batch of two, but SLO comes first: the request
    that plain decoding leaves behind its SLO is still drafted for (planned as a batch of
    one); the relaxed one decodes plainly. Output stays the target's own."""
    adaptive = {**CAPPED, "slack_margin": None}  # the behind-SLO rule alone
    engine = make_engine(target_dir, target_dir, scheduler={"adaptive": adaptive})
    assert engine.local_scheduler.plan(1)[0] > 0 and engine.local_scheduler.plan(2)[0] == 0
    ticks = itertools.count()
    engine.clock = lambda: next(ticks) * 0.05  # every clock read 50 ms on: slow iterations
    calls = record_speculate(engine)
    tight, relaxed = req(0, PROMPTS[0], 24, 60.0), req(1, PROMPTS[1], 24, 1e6)
    res = run_to_completion(engine, [engine.submit(tight), engine.submit(relaxed)])
    assert res["tokens"]["r0"] == hf_greedy(target_dir, PROMPTS[0], 24)
    assert res["tokens"]["r1"] == hf_greedy(target_dir, PROMPTS[1], 24)
    drafted = [ids for ids, _ in calls]
    # r0 alone while both run; once r0 is done, r1 is a batch of one and is drafted for
    last_r0 = max(i for i, ids in enumerate(drafted) if ids == ["r0"])
    assert all(ids == ["r0"] for ids in drafted[: last_r0 + 1])
    assert all(ids == ["r1"] for ids in drafted[last_r0 + 1 :])


@pytest.mark.parametrize("margin", [0.8, None])
def test_the_relaxed_requests_slack_buys_the_tight_one_a_tree(target_dir, margin):
    """Nobody is behind (SLOs of seconds on a fast model), and the cost cap plans plain
    decoding for the batch of three; with a slack margin the tightest request alone is
    drafted for while the relaxed ones run, without one nobody is. Output stays the
    target's own either way."""
    engine = make_engine(
        target_dir, target_dir, scheduler={"adaptive": {**CAPPED, "slack_margin": margin}}
    )
    calls = record_speculate(engine)
    reqs = [req(0, PROMPTS[0], 20, 1e4), req(1, PROMPTS[1], 40, 1e5), req(2, PROMPTS[2], 40, 1e5)]
    res = run_to_completion(engine, [engine.submit(r) for r in reqs])
    for i, r in enumerate(reqs):
        assert res["tokens"][r.id] == hf_greedy(target_dir, PROMPTS[i], r.sampling.max_tokens)
    drafted = [ids for ids, _ in calls]
    if margin is None:
        assert drafted == []  # nor for r1, r2: a batch of two, one SLO level
    else:
        assert drafted and all(ids == ["r0"] for ids in drafted)


def test_seeded_sampling_is_identical_with_and_without_speculation(target_dir):
    outs = []
    for drafter in (target_dir, None):
        engine = make_engine(target_dir, drafter)
        streams = [
            engine.submit(req(i, PROMPTS[i], 16, 40.0, temperature=0.9, top_p=0.9, seed=1234 + i))
            for i in range(3)
        ]
        outs.append(run_to_completion(engine, streams)["tokens"])
    assert outs[0] == outs[1]


def test_abort_frees_target_and_drafter_state(target_dir):
    engine = make_engine(target_dir, target_dir)
    s = engine.submit(req(0, PROMPTS[0], 200, 50.0))
    keep = engine.submit(req(1, PROMPTS[1], 10, 50.0))
    for _ in range(3):
        engine.step()
    assert engine.target.kv_usage() > 0
    engine.abort("r0")
    res = run_to_completion(engine, [s, keep])
    assert res["finish"] == {"r0": "abort", "r1": "length"}
    assert res["tokens"]["r1"] == hf_greedy(target_dir, PROMPTS[1], 10)  # neighbour unharmed
    assert engine.target.kv_usage() == 0.0
    assert engine.drafter.inner.runner.kv_usage() == 0.0
    assert engine.stats().tracked == 0


def test_deadline_expires_request(target_dir):
    engine = make_engine(target_dir, None)
    s = engine.submit(
        GenerationRequest(
            id="t",
            prompt_token_ids=(1, 2),
            tpot_slo_ms=50.0,
            timeout_s=0.05,
            sampling=SamplingParams(max_tokens=400, ignore_eos=True),
        )
    )
    engine.step()
    time.sleep(0.06)
    res = run_to_completion(engine, [s])
    assert res["finish"]["t"] == "timeout"
    assert engine.target.kv_usage() == 0.0


def test_bad_input_and_backpressure(target_dir):
    engine = make_engine(target_dir, None, engine={"max_queue": 2})
    with pytest.raises(ValueError, match="context length"):
        engine.submit(req(0, [1] * 500, 100, 50.0))
    with pytest.raises(ValueError, match="token ids"):
        engine.submit(req(0, [1, 10_000], 4, 50.0))
    engine.submit(req(1, [1], 4, 50.0))
    engine.submit(req(2, [1], 4, 50.0))
    with pytest.raises(EngineFull):
        engine.submit(req(3, [1], 4, 50.0))


def test_threaded_loop_streams_to_a_reader(target_dir):
    engine = make_engine(target_dir, target_dir)
    engine.start()
    try:
        s = engine.submit(req(0, PROMPTS[2], 12, 50.0))
        toks: list[int] = []
        while True:
            d = s.get(timeout=10)
            assert d is not None, "engine thread stalled"
            toks.extend(d.token_ids)
            if d.finish_reason:
                break
    finally:
        engine.stop()
    assert toks == hf_greedy(target_dir, PROMPTS[2], 12)
    assert np.isfinite(engine.tspec.predict_ms(4))


def test_prefill_time_is_an_iteration_phase(target_dir):
    """Prefill blocks decoding, so its time is exported next to the decode phases (the
    simulator validation compares it with the profile's prefill table)."""
    from prometheus_client import REGISTRY

    engine = make_engine(target_dir, None)

    def count_sum() -> tuple[float, float]:
        get = REGISTRY.get_sample_value
        return (
            get("adaserve_iteration_seconds_sum", {"phase": "prefill"}) or 0.0,
            get("adaserve_iteration_seconds_count", {"phase": "prefill"}) or 0.0,
        )

    s0, n0 = count_sum()
    run_to_completion(engine, [engine.submit(req(i, PROMPTS[i], 4, 50.0)) for i in range(2)])
    s1, n1 = count_sum()
    assert n1 - n0 >= 1 and s1 > s0


def test_host_time_outside_the_model_phases_is_a_phase(target_dir, monkeypatch):
    """Streaming and bookkeeping between the model phases delay every running request;
    the `host` phase measures them (the simulator validation fits its per-iteration
    overhead to it). A slow stop check shows up there and not in the decode phases."""
    from prometheus_client import REGISTRY

    def sample(phase: str) -> tuple[float, float]:
        get = REGISTRY.get_sample_value
        labels = {"phase": phase}
        return (
            get("adaserve_iteration_seconds_sum", labels) or 0.0,
            get("adaserve_iteration_seconds_count", labels) or 0.0,
        )

    engine = make_engine(target_dir, None)
    apply = output.apply_tokens
    # The slow apply advances the engine's clock by 10 s instead of sleeping, so the
    # check holds however long a forward takes on a loaded machine.
    skew = [0.0]
    engine.clock = lambda: time.monotonic() + skew[0]

    def slow_apply(*args, **kwargs):
        skew[0] += 10.0
        return apply(*args, **kwargs)

    monkeypatch.setattr(output, "apply_tokens", slow_apply)
    (h0, n0), (t0, _) = sample("host"), sample("total")
    iterations = engine.stats().iterations
    run_to_completion(engine, [engine.submit(req(0, PROMPTS[0], 6, 50.0))])
    (h1, n1), (t1, _) = sample("host"), sample("total")
    steps = engine.stats().iterations - iterations
    assert steps >= 5 and n1 - n0 == steps  # one observation per decode iteration
    assert h1 - h0 >= steps * 10.0  # every step's slow apply
    assert t1 - t0 < 10.0  # the decode phases (a tiny model's forwards) do not see it


def test_spec_metrics_count_emitted_tokens(target_dir):
    """vLLM-style spec-decode counters: emitted / drafts is the tokens per verification
    step that dashboards (and benchmarks/sim/validate_cpu.py) read."""
    engine = make_engine(target_dir, target_dir)  # self-drafting: chains are accepted
    drafts = metrics.spec_num_drafts._value.get()
    emitted = metrics.spec_emitted_tokens._value.get()
    accepted = metrics.spec_num_accepted_tokens._value.get()
    res = run_to_completion(engine, [engine.submit(req(0, PROMPTS[0], 24, 50.0))])
    d = metrics.spec_num_drafts._value.get() - drafts
    e = metrics.spec_emitted_tokens._value.get() - emitted
    a = metrics.spec_num_accepted_tokens._value.get() - accepted
    assert d > 0 and e == a + d  # every step emits its accepted tokens plus one
    assert e <= len(res["tokens"]["r0"]) and e / d > 1.5
