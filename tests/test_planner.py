"""The iteration's plan (adaserve/engine/planner.py): no draft step where the tree
budget leaves no token past the roots, or too few to pay for it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from adaserve import metrics
from adaserve.engine.planner import form_step
from tests._engine import PROMPTS, hf_greedy, make_engine, req, run_to_completion
from tests._engine import target_dir as target_dir  # the module's fixture


@pytest.mark.parametrize(("policy", "budget"), [("adaserve", 2), ("adaserve", 64), ("global", 2)])
def test_no_draft_step_where_no_drafted_token_could_be_verified(
    target_dir, policy: str, budget: int
) -> None:
    # Three decoding requests with relaxed SLOs (none behind, so no SLO tree) and d_min
    # 1: the depth plan drafts for every one. Under policy adaserve a knee budget of 2
    # leaves the split no token past the three roots, so the plan is plain decoding; 64
    # leaves room, and every request is drafted for. A baseline (policy global) drafts
    # whatever the budget, as the system it stands for does. The output is the target's
    # greedy output every time.
    engine = make_engine(
        target_dir,
        drafter_dir=target_dir,
        scheduler={"policy": policy, "budget": budget, "adaptive": {"d_min": 1}},
    )
    prompts = [list(PROMPTS[i]) for i in range(3)]
    streams = [engine.submit(req(i, p, 12, 1e5)) for i, p in enumerate(prompts)]
    engine.step()  # admitted (and prefilled, prompts this short)
    while any(r.prefilling for r in engine.pool.running.values()) or engine.pool.waiting:
        engine.step()
    plan = form_step(engine)
    assert len(plan.decoding) == 3
    if policy == "adaserve" and budget == 2:
        assert plan.batch.tree_budget <= 3
        assert (plan.drafted, plan.depth) == ([], 0)
    else:
        assert (plan.batch.tree_budget > 3) is (budget > 3)
        assert len(plan.drafted) == 3 and plan.depth >= 1
    out = run_to_completion(engine, streams)
    for i, p in enumerate(prompts):
        assert out["tokens"][f"r{i}"] == hf_greedy(target_dir, p, 12)


@pytest.mark.parametrize("policy", ["adaserve", "global"])
def test_a_draft_step_the_budgets_room_cannot_pay_for_is_not_planned(
    target_dir, policy: str
) -> None:
    # A knee budget of 4 and three decoding requests with relaxed SLOs: the split leaves
    # one token past the roots, so a draft step for all three buys one verified token at
    # most, and the cost model (a step costs 1.84 tokens, as the simulator's CPU profile
    # has it) prefers plain decoding, d_min 1 notwithstanding. A baseline drafts. The
    # output is the target's greedy output either way.
    engine = make_engine(
        target_dir,
        drafter_dir=target_dir,
        scheduler={
            "policy": policy,
            "budget": 4,
            "adaptive": {"d_min": 1, "draft_cost_tokens": 1.84, "acceptance": 0.75},
        },
    )
    prompts = [list(PROMPTS[i]) for i in range(3)]
    streams = [engine.submit(req(i, p, 12, 1e5)) for i, p in enumerate(prompts)]
    engine.step()
    while any(r.prefilling for r in engine.pool.running.values()) or engine.pool.waiting:
        engine.step()
    plan = form_step(engine)
    assert len(plan.decoding) == 3 and plan.batch.tree_budget == 4
    if policy == "adaserve":
        assert (plan.drafted, plan.depth) == ([], 0)
    else:
        assert len(plan.drafted) == 3 and plan.depth >= 1
    out = run_to_completion(engine, streams)
    for i, p in enumerate(prompts):
        assert out["tokens"][f"r{i}"] == hf_greedy(target_dir, p, 12)


def test_plans_without_room_keep_the_output_under_chunks_preemption_and_prefix_reuse(
    target_dir,
) -> None:
    # A knee budget of 2: whenever two or more requests decode, the plan is plain
    # decoding; one alone is drafted for. Prompts share a 40-token start (prefix cache
    # hits), are prefilled in 16-token chunks, and 8 KV blocks of 16 cannot hold all
    # four (preemption and recompute). The tokens are the plain engine's, and the first
    # request's are Hugging Face's greedy ones.
    shared = list(range(2, 42))
    prompts = [[*shared, *own] for own in ([3, 4, 5], [9] * 7, [200], [7, 1, 7, 1])]
    lengths = [20, 25, 15, 12]
    outs, reports = {}, []
    for spec in (True, False):
        engine = make_engine(
            target_dir,
            drafter_dir=target_dir,
            engine={
                "speculation": spec,
                "kv_blocks": 8,
                "kv_watermark": 0.0,
                "max_batch_tokens": 16,
                "min_prefill_tokens": 16,
            },
            scheduler={"budget": 2, "adaptive": {"d_min": 1}},
        )
        hits = metrics.prefix_cache_hits._value.get()
        streams = [
            engine.submit(req(i, p, n, 1e5))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        outs[spec] = run_to_completion(engine, streams, reports=reports if spec else None)
        assert metrics.prefix_cache_hits._value.get() > hits
    assert outs[True]["tokens"] == outs[False]["tokens"]
    assert outs[True]["tokens"]["r0"] == hf_greedy(target_dir, prompts[0], lengths[0])
    assert any(r.preempted for r in reports)
    # Plain iterations of two or more decoders, and drafted ones of one.
    assert any(len(r.sources) >= 2 and set(r.sources.values()) == {"none"} for r in reports)
    assert any("model" in r.sources.values() for r in reports)


def test_with_no_decoder_a_short_prompt_goes_ahead_of_a_distant_ttft_deadline(
    target_dir,
) -> None:
    # Policy adaserve with `slo_prefill`, 16-token chunks: a 160-token prompt whose TTFT
    # SLO is 1,000 s away, then a 6-token one without a TTFT SLO. No request decodes yet,
    # so the prompts go in deadline order (the short one's default 10 s first): its
    # first token comes while the long prompt is still being prefilled. The tokens are
    # Hugging Face's greedy ones either way.
    engine = make_engine(
        target_dir,
        drafter_dir=target_dir,
        engine={"max_batch_tokens": 16, "min_prefill_tokens": 16},
    )
    long, short = list(range(3, 163)), [5, 9, 2, 7, 1, 4]
    streams = [
        engine.submit(replace(req(0, long, 6, 1e5), ttft_slo_ms=1e6)),
        engine.submit(req(1, short, 6, 1e5)),
    ]
    firsts: list[str] = []

    def note_firsts(step: int) -> None:
        firsts.extend(
            r.req.id
            for r in engine.pool.running.values()
            if r.num_generated and r.req.id not in firsts
        )

    out = run_to_completion(engine, streams, on_step=note_firsts)
    assert firsts[0] == "r1"
    assert out["tokens"]["r0"] == hf_greedy(target_dir, long, 6)
    assert out["tokens"]["r1"] == hf_greedy(target_dir, short, 6)
