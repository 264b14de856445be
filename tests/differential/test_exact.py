"""The defects a user found against `adaserve up --all-in-one`, through the real gateway
and engine with the embedded SmolLM2 pair: stop strings exact under speculation, the
completions endpoint's response_format, and tool_choice required with a length cut."""

from __future__ import annotations

import json

import jsonschema
import pytest

from adaserve.bench.fuzz_cases import WEATHER
from tests.differential._helpers import METHODS, post, stream_chat

pytestmark = pytest.mark.slow  # one all-in-one server with the embedded pair

QUESTIONS = ["Explain photosynthesis briefly.", "Write a story about a cat."]


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_stop_string_ends_usage_and_logprobs_where_plain_decoding_does(
    server: str, question: str
) -> None:
    # Reported: the same text, but 42 completion tokens and logprobs with method none
    # and 43 with model / auto (accepted tokens past the stop string were kept).
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 80,
        "temperature": 0,
        "stop": ["."],
        "logprobs": True,
    }
    seen = set()
    for method in METHODS:
        out = post(server, "chat/completions", body, method)
        (c,) = out["choices"]
        whole = (
            c["message"]["content"],
            len(c["logprobs"]["content"]),
            out["usage"]["completion_tokens"],
            c["finish_reason"],
        )
        assert whole[1] == whole[2] and whole[3] == "stop", whole
        assert stream_chat(server, body, method) == whole, method
        seen.add(whole)
    assert len(seen) == 1, seen


SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
    "required": ["colour", "n"],
    "additionalProperties": False,
}


def test_completions_honour_response_format(server: str) -> None:
    # Reported: {"type": "json_object"} answered 200 with free text (the field was
    # parsed and dropped on /v1/completions).
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    body = {"prompt": "My favourite colour is", "max_tokens": 40, "temperature": 0}
    texts = set()
    for method in ("none", "model"):
        (c,) = post(server, "completions", {**body, "response_format": rf}, method)["choices"]
        jsonschema.validate(json.loads(c["text"]), SCHEMA)
        texts.add(c["text"])
    assert len(texts) == 1
    out = post(server, "completions", {**body, "response_format": {"type": "json_object"}}, "model")
    text = out["choices"][0]["text"]
    assert text.lstrip().startswith("{")  # the grammar's first character, not free text
    if out["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def _calls(c: dict) -> list[tuple[str, dict]]:
    return [
        (t["function"]["name"], json.loads(t["function"]["arguments"]))
        for t in c["message"].get("tool_calls") or []
    ]


def test_required_tool_calls_survive_a_length_cut(server: str) -> None:
    # Reported: with max_tokens 60 the model repeats the call until the cut, and the
    # partial array came back as content with no tool call.
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0}
    for method in ("none", "model"):
        out = post(server, "chat/completions", {**body, "max_tokens": 60}, method)
        (c,) = out["choices"]
        assert out["usage"]["completion_tokens"] == 60 and c["finish_reason"] == "length"
        calls = _calls(c)
        assert calls and c["message"]["content"] is None
        for name, args in calls:
            assert name == "get_weather"
            jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_parallel_tool_calls_false_is_exactly_one_call(server: str) -> None:
    body = {
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 200,
    }
    seen = []
    for method in ("none", "model"):
        (c,) = post(server, "chat/completions", body, method)["choices"]
        assert c["finish_reason"] == "tool_calls" and len(_calls(c)) == 1
        seen.append(_calls(c))
    assert seen[0] == seen[1]
