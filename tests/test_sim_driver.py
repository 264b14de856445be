"""The discrete-event driver running the real engine and selection: determinism,
conservation, and every policy's token budget."""

from __future__ import annotations

import pytest

from adaserve.sim.driver import simulate
from adaserve.sim.policies import SPECINFER_EXPANSION, policy_spec
from tests._sim import LLAMA, small_workload


def _strip(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "sim_wall_s"}


def test_fixed_seed_is_deterministic():
    wl = small_workload()
    a = simulate(wl, "adaserve")
    b = simulate(wl, "adaserve")
    assert _strip(a.summary) == _strip(b.summary)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]
    c = simulate(wl, "adaserve", seed=4)
    assert [r.to_dict() for r in c.records] != [r.to_dict() for r in a.records]


@pytest.mark.parametrize("policy", ["adaserve", "spec-3", "cb"])
def test_every_request_finishes_once_and_tokens_add_up(policy):
    wl = small_workload(units=2)
    res = simulate(wl, policy)
    requests = wl.generate(wl.rps, wl.duration_s, wl.seed, res.summary["baseline_tpot_ms"])
    assert sorted(r.id for r in res.records) == sorted(r.id for r in requests)
    by_id = {r.id: r for r in requests}
    for rec in res.records:
        assert rec.finish_reason == "length"
        assert rec.num_tokens == by_id[rec.id].output_tokens  # ignore_eos: all of max_tokens
        assert rec.arrival_s <= rec.first_token_s <= rec.last_token_s <= rec.finish_s
    # Prefill emits each request's first token; verification emits the rest.
    emitted = sum(u.target.stats.emitted for u in res.units)
    assert sum(r.num_tokens for r in res.records) == emitted + len(res.records)
    assert {r.unit for r in res.records} == {0, 1}  # the router used both units
    for u in res.units:
        assert not u.engine.has_work() and not u.active
        assert u.target.kv_usage() == 0  # every sequence freed
        if u.drafter is not None:
            assert not u.drafter._len  # every drafter state released
    assert res.summary["requests"] == len(requests)
    # Tokens per step with a draft (what a live server's spec-decode counters report)
    # are at least the mean over all steps, and undefined where nothing was drafted.
    per_draft = res.summary["mean_emitted_per_draft"]
    if policy == "cb":
        assert per_draft is None
    else:
        assert per_draft >= res.summary["mean_accepted"] >= 1.0


@pytest.mark.parametrize(
    "policy",
    ["adaserve", "paper", "equal", "global", "spec-1", "spec-4", "specinfer", "cb", "cb-priority"],
)
def test_each_policy_honours_its_budget(policy):
    wl = small_workload(rps=6.0)
    res = simulate(wl, policy)
    budget = wl.settings["scheduler"]["budget"]
    batches = res.units[0].target.stats.batches
    assert batches
    for n, tokens, prefill in batches:
        if policy in ("paper", "equal", "global"):
            assert n <= tokens <= max(budget, n)
        elif policy == "adaserve":
            assert n <= tokens
        elif prefill:
            # Beside prefill chunks whose TTFT deadlines need the room, batch formation
            # lets throughput trees give way, for every policy alike (roots stay).
            assert n <= tokens
        elif policy.startswith("spec-"):
            assert tokens == n * (int(policy.split("-")[1]) + 1)  # the whole chain
        elif policy == "specinfer":
            assert tokens == n * 21  # <1,1,3,1,1,1,1,1>: 20 drafted nodes + root
        else:
            assert tokens == n  # no speculation: roots only
    if policy in ("equal", "global"):
        # the budget binds under load: selection spends it, not more
        assert max(t for _, t, _ in batches) == budget
    if policy == "adaserve":
        # adaserve stops where a node no longer pays for its verify time, so it may
        # leave part of its budget unspent, but it still speculates, never past one
        # forward
        assert any(t > n for n, t, _ in batches)
        assert max(t for _, t, _ in batches) <= res.settings.engine.max_batch_tokens
    if policy in ("adaserve", "equal", "global"):
        assert res.summary["mean_accepted"] > 1.5
    if policy.startswith("cb"):
        assert res.summary["mean_accepted"] == 1.0


def test_adaserve_sizes_the_iteration_by_the_tightest_slo():
    # Policy adaserve with scheduler.slo_budget lets an iteration verify more tree
    # tokens than the knee while its tightest request keeps pace; without the setting
    # (the default), and for policy paper (Algorithm 2 as published), the knee is the cap.
    wl = small_workload(rps=8.0)
    budget = wl.settings["scheduler"]["budget"]

    def most(policy: str, **scheduler) -> int:
        res = simulate(wl, policy, overrides={"scheduler": scheduler} if scheduler else None)
        return max(t for _, t, _ in res.units[0].target.stats.batches)

    assert most("adaserve", slo_budget=True) > budget
    assert most("adaserve") <= budget
    assert most("paper") <= budget


def test_adaserve_holds_prompts_while_a_decoder_is_behind():
    # Under overload decoders fall behind their TPOT SLO and policy adaserve holds
    # prompts that have TTFT slack (scheduler.hold_prompts): their first tokens come
    # later, and every request still finishes. Policy paper admits as before. Admission
    # in arrival order: ordered by deadline, this load no longer leaves a decoder behind,
    # and the hold has nothing to do.
    wl = small_workload(rps=10.0)
    for c in wl.classes.values():
        c.slo.ttft_ms = 3000.0

    def mean_ttft(policy: str, **scheduler) -> float:
        overrides = {"scheduler": scheduler, "engine": {"admission_order": "arrival"}}
        res = simulate(wl, policy, overrides=overrides)
        assert all(r.finish_reason in ("stop", "length") for r in res.records)
        return sum(r.ttft_ms for r in res.records) / len(res.records)

    assert mean_ttft("adaserve") > mean_ttft("adaserve", hold_prompts=False)
    assert mean_ttft("paper") == mean_ttft("paper", hold_prompts=True)


def test_policy_specs():
    assert policy_spec("spec", 16, k=5).name == "spec-5"
    assert policy_spec("specinfer", 8).expansion == SPECINFER_EXPANSION
    assert not policy_spec("cb", 8).speculative
    # Only adaserve drafts from a prompt's tail; every baseline reads whole prompts.
    for name in ("paper", "spec-2", "specinfer"):
        assert policy_spec(name, 8).overrides["speculation"] == {"draft_context": None}
    assert "speculation" not in policy_spec("adaserve", 8).overrides
    with pytest.raises(ValueError, match="unknown policy"):
        policy_spec("vllm", 8)
    with pytest.raises(ValueError, match="spec-K"):
        policy_spec("spec-0", 8)


def _admission_order(res):
    return sorted(res.records, key=lambda r: (r.first_token_s, r.id))


@pytest.mark.parametrize("policy", ["cb", "cb-priority"])
def test_cb_priority_admits_tight_slos_first(policy):
    # A burst into two slots: admission order is all that differs between the policies.
    wl = small_workload(rps=200.0, duration_s=0.1, settings={"engine": {"max_running": 2}})
    res = simulate(wl, policy)
    order = _admission_order(res)
    slo = {r.id: r.tpot_slo_ms for r in res.records}
    arrival = {r.id: r.arrival_s for r in res.records}
    # pairs (a admitted before b) where b arrived first / b has the tighter SLO
    by_arrival = sum(
        arrival[b.id] < arrival[a.id] for i, a in enumerate(order) for b in order[i + 1 :]
    )
    by_slo = sum(
        slo[b.id] < slo[a.id] and arrival[b.id] <= arrival[a.id]
        for i, a in enumerate(order)
        for b in order[i + 1 :]
    )
    if policy == "cb":
        assert by_arrival == 0  # first come, first served
    else:
        assert by_slo == 0 and by_arrival > 0  # tight SLOs jump the queue


def test_cb_serves_in_arrival_order_when_ttft_slos_are_lost():
    # A burst against TTFT SLOs most prompts miss: policy adaserve defers the lost ones
    # (scheduler.defer_lost_ttft) behind later arrivals that can still make theirs; cb
    # is vLLM's first come, first served whatever its TTFT SLOs (it ran adaserve's
    # deferral by accident once).
    wl = small_workload(rps=200.0, duration_s=0.2, settings={"engine": {"max_batch_tokens": 64}})
    for c in wl.classes.values():
        c.slo.ttft_ms = 40.0

    def out_of_arrival_order(policy: str, **engine) -> int:
        res = simulate(wl, policy, overrides={"engine": engine} if engine else None)
        order = _admission_order(res)
        arrival = {r.id: r.arrival_s for r in res.records}
        return sum(
            arrival[b.id] < arrival[a.id] for i, a in enumerate(order) for b in order[i + 1 :]
        )

    assert out_of_arrival_order("cb") == 0
    assert out_of_arrival_order("adaserve", speculation=False, admission_order="arrival") > 0


def test_planner_gets_the_profiles_draft_cost_in_verify_tokens():
    from adaserve.sim.costmodel import load_profile
    from adaserve.sim.driver import draft_cost_tokens, engine_settings, workload_profile
    from adaserve.sim.workload import load_workload

    profile = load_profile("llama-3.1-70b-tp4-a100")
    # Draft step ~4.8 ms at 128 tokens over (85 - 55) / 128 ms per verify token above B.
    assert draft_cost_tokens(profile, 128) == pytest.approx(4.833 / (30 / 128), rel=1e-3)
    wl = load_workload("workloads/adaserve-eurosys.yaml")
    settings = engine_settings(wl, workload_profile(wl), policy_spec("adaserve", 64))
    adaptive = settings.scheduler.adaptive
    assert adaptive.draft_cost_tokens == pytest.approx(20.62, rel=1e-3)
    assert (adaptive.d_max, adaptive.c1) == (6, -8)  # the workload's own settings stay


def _profile_file(tmp_path, name: str, k: float, trace: list[dict] | None) -> str:
    """LLAMA with its tables times `k` and `trace` as its speed trace; no iteration
    overhead and a pinned SLO baseline, so only the charged costs differ."""
    import yaml

    from adaserve.sim.costmodel import load_profile

    prof = load_profile(LLAMA).model_dump()
    prof["verify"]["ms"] = [[k * m for m in row] for row in prof["verify"]["ms"]]
    prof["draft_step"]["ms"] = [k * m for m in prof["draft_step"]["ms"]]
    prof["prefill"]["ms"] = [k * m for m in prof["prefill"]["ms"]]
    prof["iteration_overhead_ms"] = 0.0
    prof["baseline_tpot_ms"] = load_profile(LLAMA).baseline_ms()
    prof["speed_trace"] = trace or []
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(prof))
    return str(path)


@pytest.mark.parametrize("k", [2.0, 0.5])
def test_constant_speed_trace_equals_scaled_tables(tmp_path, k):
    """A speed trace of constant factor k simulates exactly what the profile with its
    verify, draft and prefill tables multiplied by k does (k a power of two: exact)."""
    trace = [{"t_s": 0.0, "verify": k, "draft": k, "prefill": k}]
    traced = small_workload(profile=_profile_file(tmp_path, "traced", 1.0, trace))
    scaled = small_workload(profile=_profile_file(tmp_path, "scaled", k, None))
    a = simulate(traced, "adaserve", phase_window_s=2.0)
    b = simulate(scaled, "adaserve", phase_window_s=2.0)
    assert _strip(a.summary) == _strip(b.summary)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]
    plain = simulate(
        small_workload(profile=_profile_file(tmp_path, "plain", 1.0, None)), "adaserve"
    )
    assert plain.summary["verify_ms_total"] != a.summary["verify_ms_total"]


def test_phase_windows_add_up_to_the_run_totals(tmp_path):
    trace = [{"t_s": 2.0, "verify": 2.0, "draft": 2.0, "prefill": 2.0}, {"t_s": 4.0}]
    res = simulate(
        small_workload(profile=_profile_file(tmp_path, "p", 1.0, trace)),
        "adaserve",
        phase_window_s=1.5,
    )
    s = res.summary
    pw = s["phase_windows"]
    assert pw["window_s"] == 1.5
    assert [w["t_s"] for w in pw["windows"]] == [1.5 * i for i in range(len(pw["windows"]))]
    assert sum(w["iterations"] for w in pw["windows"]) == s["iterations"]
    for key in ("verify_ms", "draft_ms", "prefill_ms"):
        assert sum(w[key] for w in pw["windows"]) == pytest.approx(s[f"{key}_total"])
    assert "phase_windows" not in simulate(small_workload(), "adaserve").summary
    with pytest.raises(ValueError, match="phase window"):
        simulate(small_workload(), "adaserve", phase_window_s=0.0)


def test_the_drafter_reads_only_a_prompts_tail_under_adaserve():
    # speculation.draft_context: the drafter is sent only the last 64 tokens of each
    # prompt (the summarization class's are ~600), then the tokens generated; every
    # request still gets all its tokens.
    wl = small_workload()
    requests = wl.generate(wl.rps, wl.duration_s, wl.seed, 30.0)

    def tokens_read(context: int | None) -> int:
        res = simulate(wl, "adaserve", overrides={"speculation": {"draft_context": context}})
        assert all(r.num_tokens == r.max_tokens for r in res.records)
        (unit,) = res.units
        return unit.drafter.tokens_read

    outputs = sum(r.output_tokens for r in requests)
    assert tokens_read(None) >= sum(r.prompt_tokens for r in requests)
    assert tokens_read(64) <= sum(min(r.prompt_tokens, 64) for r in requests) + outputs
