"""The end-to-end benchmark's walk ratio: a pass through the prompt set is weighted by
time, so a prompt that takes long counts for more than one that is over quickly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling _server.py
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_spec_server", BENCH / "bench_spec_server.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


def _row(elapsed: list[float], tokens: int = 64) -> dict:
    return {"tokens": [tokens] * len(elapsed), "elapsed_s": elapsed}


def test_walk_ratio_is_throughput_over_each_pass(bench) -> None:
    # Two passes of two rounds: 2x on a short prompt, 1x on a long one.
    spec = _row([1.0, 4.0, 1.0, 4.0])
    base = _row([2.0, 4.0, 2.0, 4.0])
    assert bench.walk_ratios(spec, base, 2) == pytest.approx([6 / 5, 6 / 5])
    # One round a pass (8 concurrent requests send every prompt at once): per round.
    assert bench.walk_ratios(spec, base, 1) == pytest.approx([2.0, 1.0, 2.0, 1.0])
    # A trailing partial pass is left out.
    assert len(bench.walk_ratios(_row([1.0] * 5), _row([1.0] * 5), 2)) == 2


def test_prompt_sets(bench) -> None:
    builtin = bench.prompt_set(None)
    assert [m[0]["content"] for m in builtin] == bench.PROMPTS
    summaries = bench.prompt_set("summarize")
    assert len(summaries) == 8
    # the source to summarize is in the prompt: what the n-gram drafter copies from
    assert all(len(m[-1]["content"]) > 200 for m in summaries)
    with pytest.raises(SystemExit):
        bench.prompt_set("poetry")


def test_step_summary_from_counter_differences(bench) -> None:
    delta = {
        "steps/ngram": 30.0,
        "emitted/ngram": 75.0,
        "draft/ngram": 60.0,
        "accepted/ngram": 45.0,
        "steps/none": 10.0,
        "emitted/none": 10.0,
    }
    got = bench.step_summary(delta)
    assert got["tokens_per_step"] == pytest.approx(85 / 40)
    assert got["acceptance"] == pytest.approx(45 / 60)
    assert got["sources"] == {"ngram": 0.75, "none": 0.25}
    assert bench.step_summary({})["tokens_per_step"] == 1.0
