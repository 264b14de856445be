"""Admission control in one process (real tiny models): bounded queues when the KV cache
is exhausted, duplicate request ids refused before they can share a KV sequence, the
`engine.unattainable_slo` policy, and draft-state releases that never cost a drafter
timeout per finishing request while the drafter is down."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest

from adaserve import metrics
from adaserve.adaptive import plan_depth_width
from adaserve.config import load_settings
from adaserve.drafter import Drafter, DraftUpdate
from adaserve.engine import FLOOR_HYSTERESIS, Engine, EngineFull, SLOUnattainable
from adaserve.engine.admission import SLO_FIRST_MAX_WAIT_S, drafts_cost_more
from adaserve.engine.estimates import ALPHA
from adaserve.engine.planner import riding_prefill
from adaserve.engine.state import Request
from adaserve.methods import chain_tokens
from adaserve.model.loader import load_runner
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
from adaserve.speculate import BeamDrafter
from adaserve.tree import CandidateTree
from tests._engine import PROMPTS, hf_greedy, req, run_to_completion
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("admission-target"), "llama", seed=0)


def engine_with(
    target_dir, *, kv_blocks: int = 512, drafter: Drafter | None = None, **engine: object
) -> Engine:
    settings = load_settings(None, engine={"kv_block_size": 16, **engine})
    runner = load_runner(target_dir, device="cpu", dtype="float32", kv_blocks=kv_blocks)
    return Engine(
        target=RunnerTarget(runner, eos_token_ids=()),
        drafter=drafter,
        scheduler=LocalScheduler(settings.scheduler),
        settings=settings,
    )


def test_blocks_on_demand_admit_more_and_preempt_when_they_run_out(target_dir) -> None:
    """10 blocks of 16 tokens; four requests of 5 + 40 tokens (3 blocks each at the end).
    The old worst-case reservation ran two at a time; blocks taken on demand run all
    four at once, and when they outgrow the cache the request with the most slack is
    preempted, recomputed later, and every output is the target's own."""
    engine = engine_with(target_dir, kv_blocks=10, max_queue=8, max_running=64)
    preempted = metrics.preemptions_total._value.get()
    slos = [30.0, 40.0, 1e5, 1e6]  # r3, then r2, have the most slack
    streams = [engine.submit(req(i, PROMPTS[0], 40, slos[i])) for i in range(4)]
    engine.step()
    assert engine.stats().running == 4  # all admitted at once
    res = run_to_completion(engine, streams)
    ref = hf_greedy(target_dir, PROMPTS[0], 40)
    assert all(res["tokens"][f"r{i}"] == ref for i in range(4))
    assert metrics.preemptions_total._value.get() > preempted
    assert engine.target.kv_usage() == 0.0
    assert isinstance(engine.target, RunnerTarget)
    engine.target.runner.cache.blocks.check()


def test_the_waiting_queue_is_bounded(target_dir) -> None:
    engine = engine_with(target_dir, max_queue=2)
    streams = [engine.submit(req(i, PROMPTS[0], 4, 50.0)) for i in range(2)]
    with pytest.raises(EngineFull):
        engine.submit(req(2, PROMPTS[0], 4, 50.0))
    assert run_to_completion(engine, streams)["finish"] == {"r0": "length", "r1": "length"}


def test_a_prompt_longer_than_the_kv_cache_is_refused_at_submit(target_dir) -> None:
    engine = engine_with(target_dir, kv_blocks=4)  # 64 tokens
    with pytest.raises(ValueError, match="longer than the KV cache holds"):
        engine.submit(req(0, list(range(1, 80)), 4, 50.0))
    ok = engine.submit(req(1, PROMPTS[0], 4, 50.0))  # nothing else affected
    assert run_to_completion(engine, [ok])["finish"] == {"r1": "length"}


def test_a_live_request_id_cannot_be_reused(target_dir) -> None:
    engine = engine_with(target_dir)
    first = engine.submit(req(0, PROMPTS[1], 12, 50.0))
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit(req(0, PROMPTS[2], 12, 50.0))
    res = run_to_completion(engine, [first])
    assert res["tokens"]["r0"] == hf_greedy(target_dir, PROMPTS[1], 12)
    again = engine.submit(req(0, PROMPTS[2], 5, 50.0))  # retired: the id is free again
    assert run_to_completion(engine, [again])["tokens"]["r0"] == hf_greedy(
        target_dir, PROMPTS[2], 5
    )


def test_unattainable_slo_is_served_best_effort_by_default(target_dir) -> None:
    engine = engine_with(target_dir)
    before = metrics.best_effort_total.labels("custom")._value.get()
    tight = engine.submit(req(0, PROMPTS[0], 4, 0.001))
    fine = engine.submit(req(1, PROMPTS[0], 4, 500.0))
    flags: dict[str, set[bool]] = {"r0": set(), "r1": set()}
    for _ in range(50):
        engine.step()
        for s in (tight, fine):
            while (d := s.get(timeout=0)) is not None:
                flags[s.request_id].add(d.best_effort)
    assert flags == {"r0": {True}, "r1": {False}}
    assert metrics.best_effort_total.labels("custom")._value.get() == before + 1


def test_unattainable_slo_is_refused_under_the_reject_policy(target_dir) -> None:
    engine = engine_with(target_dir, unattainable_slo="reject")
    with pytest.raises(SLOUnattainable, match="floor"):
        engine.submit(req(0, PROMPTS[0], 4, 0.001))
    assert isinstance(SLOUnattainable("x"), ValueError)  # 400 / INVALID_ARGUMENT
    ok = engine.submit(req(1, PROMPTS[0], 4, 500.0))
    assert run_to_completion(engine, [ok])["finish"] == {"r1": "length"}


class SwitchableDrafter:
    """A real BeamDrafter behind a switch: `down` makes every call fail as an
    unreachable service would; `calls` records Release batches."""

    def __init__(self, inner: BeamDrafter) -> None:
        self.inner = inner
        self.down = False
        self.releases: list[list[str]] = []

    def speculate(
        self, updates: Sequence[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        if self.down:
            raise ConnectionError("drafter: UNAVAILABLE")
        return self.inner.speculate(list(updates), depth, width, stop_prob)

    def release(self, ids: list[str]) -> None:
        if self.down:
            raise ConnectionError("drafter: UNAVAILABLE")
        self.releases.append(list(ids))
        self.inner.release(ids)


def test_draft_state_is_released_in_batches_and_never_while_the_drafter_is_down(
    target_dir,
) -> None:
    drafter = SwitchableDrafter(
        BeamDrafter(load_runner(target_dir, device="cpu", dtype="float32", kv_blocks=256))
    )
    engine = engine_with(target_dir, drafter=drafter)
    streams = [engine.submit(req(i, PROMPTS[i], 6, 50.0)) for i in range(3)]
    engine.step()  # the prompts, handed to the drafter too: it holds all three
    assert drafter.inner.stats().num_sequences == 3
    drafter.down = True
    res = run_to_completion(engine, streams)
    for i in range(3):
        assert res["tokens"][f"r{i}"] == hf_greedy(target_dir, PROMPTS[i], 6)
    assert drafter.releases == []  # nothing attempted while it is down
    drafter.down = False
    assert engine.drafter is not None
    engine.drafter._retry_at = 0.0  # skip the 1 s back-off
    engine.step()
    assert sorted(np.concatenate(drafter.releases).tolist()) == ["r0", "r1", "r2"]
    assert len(drafter.releases) == 1 and drafter.inner.stats().num_sequences == 0


def test_slo_is_judged_at_submit_against_the_honest_floor(target_dir) -> None:
    """With a drafter (d_max 8, acceptance 0.75, the predicted 1-token iteration 42 ms
    before any is measured) the old floor, 42 / 9 = 4.7 ms, called a 10 ms SLO
    attainable; no request alone gets under ~16 ms here, so it is best-effort, and the
    verdict is on the stream before the engine has taken a step."""
    drafter = BeamDrafter(load_runner(target_dir, device="cpu", dtype="float32", kv_blocks=256))
    engine = engine_with(target_dir, drafter=drafter)
    floor = engine.slo_floor()
    assert 10.0 < floor.tpot_ms < engine.tspec.predict_ms(1) and floor.depth > 0
    tight = engine.submit(req(0, PROMPTS[0], 4, 10.0))
    fine = engine.submit(req(1, PROMPTS[0], 4, floor.tpot_ms * 1.01))
    assert tight.verdict.best_effort and tight.verdict.floor_ms == floor.tpot_ms
    assert tight.verdict.reason is not None and "floor" in tight.verdict.reason
    assert not fine.verdict.best_effort and fine.verdict.reason is None
    res = run_to_completion(engine, [tight, fine])
    assert res["finish"] == {"r0": "length", "r1": "length"}
    assert engine.info().slo_floor_ms == pytest.approx(engine.slo_floor().tpot_ms)
    rejecting = engine_with(target_dir, drafter=drafter, unattainable_slo="reject")
    with pytest.raises(SLOUnattainable, match="below this server's floor"):
        rejecting.submit(req(2, PROMPTS[0], 4, 10.0))


def test_one_floor_at_a_time(target_dir) -> None:
    """The floor every report reads (info, a verdict and its reason) moves only when the
    computed one moves by more than FLOOR_HYSTERESIS: while a request decodes, iteration
    times jitter and the learned per-token time settles, and two requests a moment apart
    must not be told two floors that differ by noise."""
    drafter = BeamDrafter(load_runner(target_dir, device="cpu", dtype="float32", kv_blocks=256))
    engine = engine_with(target_dir, drafter=drafter)
    streams = [engine.submit(req(i, PROMPTS[i % len(PROMPTS)], 24, 1e4)) for i in range(3)]
    seen: list[float] = []

    def probe(step: int) -> None:
        """Before each step: what info() reports, and what a request is told at submit
        (an SLO always below the floor: the reason names it)."""
        seen.append(engine.info().slo_floor_ms)
        p = engine.submit(req(100 + step, PROMPTS[0], 1, 1e-3))
        assert p.verdict.floor_ms == seen[-1]
        assert f"floor of {seen[-1]:g} ms" in (p.verdict.reason or "")
        engine.abort(p.request_id)

    run_to_completion(engine, streams, on_step=probe)
    assert len(seen) > 5
    moves = [(a, b) for a, b in itertools.pairwise(seen) if a != b]
    assert all(abs(b - a) > FLOOR_HYSTERESIS * a for a, b in moves), moves
    assert all(round(f, 3) == f for f in seen)  # the precision every report prints


class _Clock:
    """The engine's clock, moved by the test: arrivals and deadlines are exact."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _one_slot(target_dir, **scheduler: bool) -> tuple[Engine, _Clock]:
    """An engine with one running slot, on a clock the test moves."""
    settings = load_settings(
        None, engine={"kv_block_size": 16, "max_running": 1}, scheduler=scheduler
    )
    runner = load_runner(target_dir, device="cpu", dtype="float32", kv_blocks=64)
    clock = _Clock()
    engine = Engine(
        RunnerTarget(runner, eos_token_ids=()),
        None,
        LocalScheduler(settings.scheduler),
        settings,
        clock=clock,
    )
    return engine, clock


def _admission_order(
    target_dir,
    submits: list[tuple[float, GenerationRequest]],
    defer_lost_ttft: bool = True,
    slo_prefill: bool = True,
) -> list[str]:
    """One running slot: the order in which requests (submitted at the given times, the
    first admitted alone, the clock then moving 10 ms a step) got their first token."""
    engine, clock = _one_slot(target_dir, defer_lost_ttft=defer_lost_ttft, slo_prefill=slo_prefill)
    streams = []
    for k, (at, r) in enumerate(submits):
        clock.t = 1000.0 + at
        streams.append(engine.submit(r))
        if k == 0:
            engine.step()  # the first takes the slot; the rest queue behind it
    first: list[str] = []
    for _ in range(500):
        engine.step()
        clock.t += 0.01
        for s in streams:
            while (d := s.get(timeout=0)) is not None:
                if d.token_ids and s.request_id not in first:
                    first.append(s.request_id)
        if not engine.has_work():
            break
    return first


def _r(name: str, ttft_ms: float | None = None, tpot_ms: float = 1e5) -> GenerationRequest:
    return GenerationRequest(
        name,
        tuple(PROMPTS[0]),
        SamplingParams(max_tokens=3, ignore_eos=True),
        tpot_slo_ms=tpot_ms,
        ttft_slo_ms=ttft_ms,
    )


def test_a_tight_ttft_slo_is_admitted_ahead_of_relaxed_requests(target_dir) -> None:
    # One slot, taken by the first request: everything else queues. The tight TTFT
    # request came last and used to wait behind all of them in arrival order.
    order = _admission_order(
        target_dir,
        [
            (0.0, _r("busy")),
            (0.1, _r("plain-1")),
            (0.2, _r("relaxed-ttft", ttft_ms=60_000.0)),
            (0.3, _r("plain-2")),
            (0.4, _r("tight-tpot-plain", tpot_ms=50.0)),
            (0.5, _r("tight-ttft", ttft_ms=200.0)),
        ],
    )
    # An SLO waits on the two with a TTFT SLO: they go first, by deadline (tight-ttft
    # 0.7 s, relaxed-ttft 60.2 s). The rest are due 10 s after arrival (no TTFT SLO):
    # plain-1 10.1, plain-2 10.3, tight-tpot-plain 10.4, arrival order among them.
    assert order == ["busy", "tight-ttft", "relaxed-ttft", "plain-1", "plain-2", "tight-tpot-plain"]


def test_a_request_no_slo_waits_on_goes_behind_those_one_waits_on_for_a_bounded_time(
    target_dir,
) -> None:
    # "old" (no TTFT SLO) has waited past its due time (10 s after arrival) when
    # "tight" comes, whose TTFT SLO can still be met: "old" would only sit in the slot
    # while its prompt waits behind tight's (slo_prefill prefills tight's first), so
    # tight goes first. Once "old" has waited SLO_FIRST_MAX_WAIT_S it goes by its due
    # time again, ahead of every newcomer: none waits forever.
    assert _admission_order(
        target_dir, [(0.0, _r("busy")), (0.1, _r("old")), (12.0, _r("tight", ttft_ms=5000.0))]
    ) == ["busy", "tight", "old"]
    late = SLO_FIRST_MAX_WAIT_S + 1.0
    assert _admission_order(
        target_dir, [(0.0, _r("busy")), (0.1, _r("old")), (late, _r("tight", ttft_ms=5000.0))]
    ) == ["busy", "old", "tight"]
    # Without slo_prefill the prompts are prefilled by due time, and admitted so.
    assert _admission_order(
        target_dir,
        [(0.0, _r("busy")), (0.1, _r("old")), (12.0, _r("tight", ttft_ms=5000.0))],
        slo_prefill=False,
    ) == ["busy", "old", "tight"]


def test_requests_without_slos_are_not_starved_by_later_tight_ones(target_dir) -> None:
    # Without slo_prefill, a request without an SLO is due 10 s after arrival: past
    # that, no newcomer is due before it, however tight its TTFT SLO. (tight-1's
    # deadline passes while it waits, at 10.25 s: with defer_lost_ttft it then goes
    # behind tight-2, due 15.3 s.)
    submits = [
        (0.0, _r("busy")),
        (0.1, _r("old")),
        (10.2, _r("tight-1", ttft_ms=50.0)),
        (10.3, _r("tight-2", ttft_ms=5000.0)),
    ]
    assert _admission_order(target_dir, submits, defer_lost_ttft=False, slo_prefill=False) == [
        "busy",
        "old",
        "tight-1",
        "tight-2",
    ]
    assert _admission_order(target_dir, submits, slo_prefill=False) == [
        "busy",
        "old",
        "tight-2",
        "tight-1",
    ]
    # With it (the default), those an SLO waits on go first: tight-1, then tight-2; once
    # tight-1's deadline has passed, only tight-2, and tight-1 goes behind "old" (due
    # 10.1 s, tight-1 as if without a TTFT SLO: 20.2 s).
    assert _admission_order(target_dir, submits, defer_lost_ttft=False) == [
        "busy",
        "tight-1",
        "tight-2",
        "old",
    ]
    assert _admission_order(target_dir, submits) == ["busy", "tight-2", "old", "tight-1"]


def test_a_ttft_slo_is_judged_against_the_prompts_prefilled_before_it(target_dir) -> None:
    # Prompts without a TTFT SLO wait behind a busy slot, 10 s old: due (10 s after
    # arrival) before a new prompt's TTFT deadline. Under slo_prefill (the default) they
    # are prefilled after it, so they are not in its way: a TTFT SLO that covers its own
    # prefill and half of theirs is attainable. Judged by due time alone (slo_prefill
    # off, where they do go first) it is not.
    prompt = tuple(PROMPTS[0])
    for slo_prefill, best_effort in ((True, False), (False, True)):
        engine, clock = _one_slot(target_dir, slo_prefill=slo_prefill)
        clock.t = 1000.0
        busy = GenerationRequest(
            "busy", prompt, SamplingParams(max_tokens=50, ignore_eos=True), tpot_slo_ms=1e5
        )
        engine.submit(busy)
        engine.step()
        clock.t = 1000.1
        for k in range(4):
            engine.submit(_r(f"plain-{k}"))
        engine.step()  # (publishes the queue the judgement reads)
        queued = sum(left for _, left, _ in engine.pool.prefill_queue)
        assert queued >= 4 * len(prompt)
        n = engine.settings.engine.max_batch_tokens
        ms_per_token = engine.latency.predict_ms(0, n) / n
        clock.t = 1010.2
        ttft_ms = (len(prompt) + queued / 2) * ms_per_token
        tight = engine.submit(_r("tight", ttft_ms=ttft_ms))
        assert tight.verdict.best_effort is best_effort, slo_prefill
        if best_effort:
            assert "prompt tokens due before it" in (tight.verdict.reason or "")


def test_a_request_whose_ttft_slo_is_lost_goes_behind_those_that_can_meet_theirs(
    target_dir,
) -> None:
    # "late" waits past its TTFT deadline (0.15 s) behind the busy slot; "ontime"
    # (deadline 5.2 s) can still meet its own. Earliest deadline first serves "late"
    # first, which saves nothing; deferred, it is due as if it had no TTFT SLO (10.1 s),
    # still ahead of a request without one that came after it.
    submits = [
        (0.0, _r("busy")),
        (0.1, _r("late", ttft_ms=50.0)),
        (0.2, _r("ontime", ttft_ms=5000.0)),
        (0.3, _r("plain-after")),
    ]
    lost = metrics.ttft_lost_total.labels("custom")
    before = lost._value.get()
    assert _admission_order(target_dir, submits, defer_lost_ttft=False) == [
        "busy",
        "late",
        "ontime",
        "plain-after",
    ]
    assert lost._value.get() == before
    assert _admission_order(target_dir, submits) == ["busy", "ontime", "late", "plain-after"]
    assert lost._value.get() == before + 1


def test_a_request_is_drafted_for_unless_its_prompt_costs_the_drafter_more_than_drafts_save(
    target_dir,
) -> None:
    # drafts_cost_more: prompt x the drafter's ingest time per token against max_tokens
    # x a full batch's plain time per request-token x (1 - 1/E). With the engine's
    # own estimates (the ingest cost set here), the turning prompt length follows it.
    engine = engine_with(
        target_dir, drafter=BeamDrafter(load_runner(target_dir, device="cpu", dtype="float32"))
    )
    shapes = [(150, 16), (170, 16), (170, 20)]
    for prompt, max_tokens in shapes:
        engine.submit(
            GenerationRequest(
                f"r{prompt}-{max_tokens}",
                tuple(range(1, prompt + 1)),
                SamplingParams(max_tokens=max_tokens),
                tpot_slo_ms=1e5,
            )
        )
    engine.step()  # all admitted
    requests = [engine.pool.running[f"r{p}-{m}"] for p, m in shapes]
    n = engine.settings.engine.max_running
    adaptive = engine.settings.scheduler.adaptive
    depth, _ = plan_depth_width(n, engine.settings.scheduler.budget, adaptive)
    saved = engine.tspec.predict_ms(n) / n * (1.0 - 1.0 / chain_tokens(adaptive.acceptance, depth))
    assert saved > 0.0
    # Before the drafter has ingested anything its cost is unknown: drafted for.
    engine.costs.drafter_ingest_ms = 0.0
    assert not any(drafts_cost_more(engine, r) for r in requests)
    engine.costs.drafter_ingest_ms = saved / 10.0  # a prompt token costs 1/10 of a saving
    # 150 / 10 = 15 < 16 tokens' savings; 17 > 16; 17 < 20.
    assert [drafts_cost_more(engine, r) for r in requests] == [False, True, False]


def test_the_drafters_ingest_cost_is_measured_per_token_it_ingests(target_dir) -> None:
    # Two prompts prefilled in one forward; the drafter ingests both (nothing is
    # plain without a TTFT SLO beside them): its time per ingested token is learned
    # from that forward, the same measurement as the per-prefill-token cost (an EWMA
    # from 0, so ALPHA of it after one observation).
    engine = engine_with(
        target_dir, drafter=BeamDrafter(load_runner(target_dir, device="cpu", dtype="float32"))
    )
    streams = [engine.submit(req(i, PROMPTS[i], 4, 1e5)) for i in range(2)]
    engine.step()
    assert engine.costs.drafter_ingest_ms > 0.0
    assert engine.costs.drafter_ingest_ms * ALPHA == pytest.approx(engine.costs.ingest_ms)
    run_to_completion(engine, streams)


def _prefilling(engine: Engine) -> list[Request]:
    return [r for r in engine.pool.running.values() if r.prefilling]


def test_prefill_riding_along_counts_in_the_depth_plan_unless_a_ttft_slo_waits_on_it(
    target_dir,
) -> None:
    # planner.riding_prefill: the prompt tokens the last iteration carried, while a
    # prompt is still to prefill and no TTFT SLO waits on one (policy adaserve only).
    engine = engine_with(target_dir, max_batch_tokens=48)
    assert riding_prefill(engine, _prefilling(engine)) == 0  # idle
    decoder = engine.submit(req(0, PROMPTS[0], 40, 1e5))
    engine.step()
    engine.step()
    assert riding_prefill(engine, _prefilling(engine)) == 0  # nothing left to prefill
    engine.submit(
        req(1, [t % 250 + 1 for t in range(300)], 4, 1e5)
    )  # no TTFT SLO: 300 prompt tokens
    engine.step()
    long = engine.pool.running["r1"]
    assert long.prefilling and 0 < engine.last_prefill_tokens < 300
    assert riding_prefill(engine, _prefilling(engine)) == engine.last_prefill_tokens
    waited = GenerationRequest(
        "ttft",
        tuple(range(1, 101)),
        SamplingParams(max_tokens=4),
        tpot_slo_ms=1e5,
        ttft_slo_ms=60_000.0,
    )
    engine.submit(waited)
    engine.step()
    assert engine.pool.running["ttft"].prefilling
    assert riding_prefill(engine, _prefilling(engine)) == 0  # a TTFT SLO waits on the prompts
    paper = engine_with(target_dir, max_batch_tokens=48)
    paper.settings.scheduler.policy = "paper"
    paper.submit(req(0, PROMPTS[0], 40, 1e5))
    paper.step()
    paper.submit(req(1, [t % 250 + 1 for t in range(300)], 4, 1e5))
    paper.step()
    assert paper.pool.running["r1"].prefilling and riding_prefill(paper, _prefilling(paper)) == 0
    run_to_completion(engine, [decoder])


def test_output_is_the_targets_own_while_prefill_rides_along_in_the_depth_plan(
    target_dir,
) -> None:
    # Lossless with the riding prefill in the cost cap: a decoder drafted for while a
    # 300-token prompt without a TTFT SLO is prefilled in chunks beside it.
    engine = engine_with(
        target_dir,
        max_batch_tokens=48,
        drafter=BeamDrafter(load_runner(target_dir, device="cpu", dtype="float32")),
    )
    engine.settings.scheduler.adaptive.draft_cost_tokens = 5.0
    long_prompt = [t % 250 + 1 for t in range(300)]
    streams = [engine.submit(req(0, PROMPTS[0], 40, 1e5))]
    engine.step()
    streams.append(engine.submit(req(1, long_prompt, 8, 1e5)))
    riding = []
    res = run_to_completion(
        engine,
        streams,
        on_step=lambda _: riding.append(riding_prefill(engine, _prefilling(engine))),
    )
    assert max(riding) > 0  # the plan counted the chunks
    assert res["tokens"]["r0"] == hf_greedy(target_dir, PROMPTS[0], 40)
    assert res["tokens"]["r1"] == hf_greedy(target_dir, long_prompt, 8)
