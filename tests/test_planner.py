"""The iteration's plan (adaserve/engine/planner.py): no draft step where the tree
budget leaves no token past the roots."""

from __future__ import annotations

import pytest

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
