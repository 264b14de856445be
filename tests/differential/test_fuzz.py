"""The differential tester (adaserve/bench/fuzz.py): a fixed-seed run against the
all-in-one server finds no difference between speculative and plain decoding, and its
comparator and shrinker, on responses shaped as the gateway sends them, catch what
they must."""

from __future__ import annotations

import asyncio

import pytest

from adaserve.bench.fuzz import Fuzzer
from adaserve.bench.fuzz_cases import Case, draw, reductions
from adaserve.bench.fuzz_compare import LOGPROB_ATOL, compare, normalise

SEED = 20261128
SECONDS = 90.0  # about 15-20 cases (two requests each) on a busy 2-core CPU


@pytest.mark.slow  # the embedded pair, ~2 minutes
def test_a_fixed_seed_run_finds_no_difference(server: str) -> None:
    report = asyncio.run(Fuzzer(server, SEED, concurrency=3).run(SECONDS))
    assert report.mismatches == [], report.mismatches
    assert report.cases >= 5 and report.requests >= 2 * report.cases
    assert report.max_logprob_gap <= LOGPROB_ATOL
    covered = set(report.features)
    assert {"chat/completions", "completions", "greedy", "seeded sampling"} <= covered


def test_cases_are_reproducible_from_the_seed() -> None:
    methods = ["auto", "model", "ngram"]
    a = [draw(7, i, methods) for i in range(200)]
    assert [c.body for c in a] == [draw(7, i, methods).body for i in range(200)]
    assert a[0].body != draw(8, 0, methods).body
    feats = {f for c in a for f in c.features}
    # 200 draws cover every feature the tester knows.
    for f in (
        "stream",
        "n>1",
        "tiny max_tokens",
        "logprobs",
        "top_logprobs",
        "echo",
        "token ids",
        "penalties",
        "logit_bias",
        "min_tokens",
        "json_schema",
        "json_object",
        "regex",
        "choice",
        "tools required",
        "tools named",
        "tools auto",
        "tools none",
        "stop drawn from output",
        "stop that never occurs",
        "tpot_slo_ms",
        "ttft_slo_ms",
        "method ngram",
        "bad_words",
        "prompt_logprobs",
        "best_of",
    ):
        assert f in feats, f


def _chat(tokens: int, lp: float = -0.5) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi."},
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {
                            "token": "a",
                            "logprob": lp,
                            "top_logprobs": [{"token": "a", "logprob": lp}],
                        }
                    ]
                    * tokens
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens},
    }


def test_the_comparator_flags_the_reported_stop_string_defect() -> None:
    # The user's report: same text, one more token counted and scored with speculation.
    plain, spec = normalise(200, _chat(42), None), normalise(200, _chat(43), None)
    diffs, _ = compare(plain, spec)
    assert any(d.startswith("usage") for d in diffs)
    assert any("logprobs: plain 42 entries, spec 43" in d for d in diffs)
    # Within the tolerance: equal; past it: a difference.
    near = normalise(200, _chat(5, -0.5 + LOGPROB_ATOL / 2), None)
    assert compare(normalise(200, _chat(5), None), near)[0] == []
    far = normalise(200, _chat(5, -0.5 + 3 * LOGPROB_ATOL), None)
    assert compare(normalise(200, _chat(5), None), far)[0]


def test_streamed_chunks_normalise_like_the_whole_response() -> None:
    whole = _chat(2)
    c = whole["choices"][0]
    entry = c["logprobs"]["content"][0]
    events = [
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": "H"},
                    "logprobs": {"content": [entry]},
                    "finish_reason": None,
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "i."},
                    "logprobs": {"content": [entry]},
                    "finish_reason": "stop",
                }
            ]
        },
        {"choices": [], "usage": whole["usage"]},
    ]
    assert normalise(200, None, events) == normalise(200, whole, None)
    bad = normalise(400, {"error": {"type": "invalid_request_error", "param": "n"}}, None)
    assert compare(bad, bad)[0] == [] and compare(bad, normalise(200, whole, None))[0]


def test_shrinking_drops_fields_and_halves() -> None:
    case = Case(
        0,
        "chat/completions",
        {
            "messages": [
                {"role": "system", "content": "x"},
                {"role": "user", "content": "hello there"},
            ],
            "max_tokens": 8,
            "n": 2,
            "stop": [".", ","],
        },
        "model",
    )
    bodies = [c.body for c in reductions(case)]
    assert {"messages": case.body["messages"], "max_tokens": 8, "stop": [".", ","]} in bodies
    assert any(b["max_tokens"] == 4 for b in bodies)
    assert any(b.get("stop") == ["."] for b in bodies)
    assert any(len(b["messages"]) == 1 for b in bodies)
    assert all("messages" in b and "max_tokens" in b for b in bodies)
    # Sampling stays seeded (dropping the seed or temperature makes the two sides
    # differ by chance: the first shrinker's reproducers were such noise); it may
    # become greedy.
    sampled = Case(
        1,
        "completions",
        {"prompt": "hello", "max_tokens": 4, "temperature": 0.8, "seed": 3, "top_k": 5},
        "auto",
    )
    bodies = [c.body for c in reductions(sampled)]
    assert all(b.get("temperature") == 0.0 or "seed" in b for b in bodies)
    assert {"prompt": "hello", "max_tokens": 4, "temperature": 0.0} in bodies


def _prompt_lp(lp: float) -> list:
    return [None, {"42": {"logprob": lp, "rank": 1, "decoded_token": " a"}}]


def test_prompt_logprobs_are_compared_within_the_tolerance() -> None:
    """vLLM's prompt_logprobs, response-level (chat) or per choice (completions): the
    same tokens and ranks, logprobs within LOGPROB_ATOL, or a difference."""
    chat = _chat(3)
    same = normalise(200, {**chat, "prompt_logprobs": _prompt_lp(-1.0)}, None)
    near = normalise(200, {**chat, "prompt_logprobs": _prompt_lp(-1.0 + LOGPROB_ATOL / 2)}, None)
    far = normalise(200, {**chat, "prompt_logprobs": _prompt_lp(-1.1)}, None)
    assert compare(same, near)[0] == []
    assert compare(same, far)[0] == ["prompt_logprobs differ"]
    assert compare(same, normalise(200, chat, None))[0] == ["prompt_logprobs differ"]
    text = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
    a = normalise(200, {"choices": [{**text, "prompt_logprobs": _prompt_lp(-1.0)}]}, None)
    b = normalise(200, {"choices": [{**text, "prompt_logprobs": _prompt_lp(-2.0)}]}, None)
    assert compare(a, b)[0] == ["choice 0 prompt_logprobs differ"]
