"""The engine with KV on demand (real tiny models, one process): prefix caching and
preemption by recompute change nothing in the output, greedy or seeded sampling, and
give back every block."""

from __future__ import annotations

import pytest

from adaserve import metrics
from adaserve.request import GenerationRequest, SamplingParams
from tests._engine import hf_greedy, make_engine, run_to_completion
from tests._engine import target_dir as target_dir  # the module's fixture

SYSTEM = list(range(10, 58))  # a 48-token shared start: 3 blocks of 16


def chat(i: int, own: list[int], n: int, slo: float, **sp: object) -> GenerationRequest:
    return GenerationRequest(
        id=f"c{i}",
        prompt_token_ids=(*SYSTEM, *own),
        sampling=SamplingParams(max_tokens=n, ignore_eos=True, **sp),  # type: ignore[arg-type]
        tpot_slo_ms=slo,
    )


OWN = [[3, 4, 5], [9, 9, 9, 9, 9, 9, 9], [200], [7, 1, 7, 1]]


def run_all(engine, seeded: bool) -> dict[str, list[int]]:
    sp = {"temperature": 0.8, "top_p": 0.9, "seed": 77} if seeded else {}
    first = run_to_completion(engine, [engine.submit(chat(0, OWN[0], 20, 50.0, **sp))])
    # Later requests share the first one's start (served from the cache when it is on),
    # the last resends the first one's whole history, as a follow-up chat turn does.
    history = [*OWN[0], *first["tokens"]["c0"], 11, 12]
    later = [
        engine.submit(chat(1, OWN[1], 25, 30.0, **sp)),
        engine.submit(chat(2, OWN[2], 15, 1e4, **sp)),
        engine.submit(chat(3, history, 12, 80.0, **sp)),
    ]
    return {**first["tokens"], **run_to_completion(engine, later)["tokens"]}


@pytest.mark.parametrize("seeded", [False, True])
def test_prefix_hits_and_preemption_keep_every_output(target_dir, seeded) -> None:
    """Four engines on the same requests: prefix caching on or off, ample KV or a cache
    so small that requests are preempted and recomputed. Same tokens from all four;
    greedy ones are Hugging Face's."""
    outs, hits, preempted = {}, {}, {}
    for caching in (True, False):
        for kv in (512, 8):  # 8 blocks of 16: the four cannot all hold their KV
            engine = make_engine(
                target_dir,
                target_dir,
                engine={"prefix_caching": caching, "kv_blocks": kv, "kv_watermark": 0.0},
            )
            h0 = metrics.prefix_cache_hits._value.get()
            p0 = metrics.preemptions_total._value.get()
            outs[caching, kv] = run_all(engine, seeded)
            hits[caching, kv] = metrics.prefix_cache_hits._value.get() - h0
            preempted[caching, kv] = metrics.preemptions_total._value.get() - p0
            assert engine.target.kv_usage() == 0.0
            engine.target.runner.cache.blocks.check()
            engine.drafter.inner.runner.cache.blocks.check()
    reference = outs[False, 512]
    assert all(out == reference for out in outs.values())
    assert hits[True, 512] >= 3 * len(SYSTEM) and hits[False, 512] == 0
    assert preempted[True, 8] > 0 and preempted[False, 8] > 0 and preempted[True, 512] == 0
    if not seeded:
        first = hf_greedy(target_dir, [*SYSTEM, *OWN[0]], 20)
        assert reference["c0"] == first
        history = [*SYSTEM, *OWN[0], *first, 11, 12]
        assert reference["c3"] == hf_greedy(target_dir, history, 12)
        assert reference["c1"] == hf_greedy(target_dir, [*SYSTEM, *OWN[1]], 25)


def test_a_relaxed_request_gives_way_to_a_tight_one(target_dir) -> None:
    """Under KV pressure the victim is the request with the most slack: the relaxed
    one is preempted, the tight one never."""
    engine = make_engine(target_dir, None, engine={"kv_blocks": 7, "kv_watermark": 0.0})
    tight = engine.submit(chat(0, OWN[1], 40, 20.0))
    relaxed = engine.submit(chat(1, OWN[2], 40, 1e6))
    reports = []
    res = run_to_completion(engine, [tight, relaxed], reports=reports)
    preempted = {rid for report in reports for rid in report.preempted}
    assert preempted == {"c1"}
    assert res["tokens"]["c0"] == hf_greedy(target_dir, [*SYSTEM, *OWN[1]], 40)
    assert res["tokens"]["c1"] == hf_greedy(target_dir, [*SYSTEM, *OWN[2]], 40)
