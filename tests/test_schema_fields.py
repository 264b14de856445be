"""Generated from the gateway's request models: every field they declare is either
honoured (setting it changes what the gateway asks the unit for, or the response's
shape) or refused with a 400 naming it; none is parsed and dropped. A field added to a
model without a sample here fails the test until someone decides which it is."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel

from adaserve.config import Settings
from gateway.errors import APIError
from gateway.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    StructuredOutputs,
)
from gateway.spec import GenerateSpec, from_chat, from_completion

KNOWN = {"coding", "chat", "summarize"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "hi"}]

# Accepted and documented to change nothing (docs/API.md: identifiers and cache hints).
INERT = {"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
# Read by the gateway when it shapes the response (gateway/streaming.py's Shape), not sent
# to the unit: checked through the body's own properties below.
SHAPE = {"stream", "stream_options"}

# field -> (the value that asks for something, fields it needs beside it)
COMMON: dict[str, tuple[Any, dict[str, Any]]] = {
    "model": ("other", {}),
    "max_tokens": (7, {}),
    "temperature": (0.5, {}),
    "top_p": (0.5, {}),
    "top_k": (5, {}),
    "seed": (3, {}),
    "stop": (["x"], {}),
    "stop_token_ids": ([5], {}),
    "ignore_eos": (True, {}),
    "n": (2, {}),
    "presence_penalty": (0.5, {}),
    "frequency_penalty": (0.5, {}),
    "logit_bias": ({"5": 1.0}, {}),
    "tpot_slo_ms": (80.0, {}),
    "ttft_slo_ms": (500.0, {}),
    "slo_class": ("coding", {}),
    "priority": (1, {}),
    "request_id": ("abc", {}),
    "timeout": (5.0, {}),
    "speculation": ({"method": "none"}, {}),
    "repetition_penalty": (1.2, {}),
    "min_p": (0.1, {}),
    "min_tokens": (2, {}),
    "bad_words": (["x"], {}),
    "allowed_token_ids": ([5], {}),
    "return_tokens_as_token_ids": (True, {}),
    "prompt_logprobs": (1, {}),
    "guided_json": ({"type": "object"}, {}),
    "guided_regex": ("a+", {}),
    "guided_choice": (["a"], {}),
    "guided_grammar": ('start: "a"', {}),
    "structured_outputs": ({"regex": "a"}, {}),
    "response_format": ({"type": "json_object"}, {}),
}
COMPLETION = {
    **COMMON,
    "prompt": ("other", {}),
    "echo": (True, {}),
    "logprobs": (1, {}),
    "best_of": (2, {}),
}
CHAT = {
    **COMMON,
    "messages": ([{"role": "user", "content": "other"}], {}),
    "max_completion_tokens": (7, {}),
    "logprobs": (True, {}),
    "top_logprobs": (3, {"logprobs": True}),
    "tools": ([TOOL], {}),
    "tool_choice": ("required", {"tools": [TOOL]}),
    "parallel_tool_calls": (False, {"tools": [TOOL], "tool_choice": "required"}),
    "add_generation_prompt": (False, {}),
    "continue_final_message": (
        True,
        {
            "add_generation_prompt": False,
            "messages": [*USER, {"role": "assistant", "content": "Hel"}],
        },
    ),
}
# Values tried on a refused field until one is refused (each refusal rule tests for
# "set", a non-default value, or a value outside what adaserve offers).
REFUSAL_PROBES: list[Any] = [True, False, 2.0, "outlines", {"a": "b"}, ["x"]]


def _spec(model: type[BaseModel], body: dict[str, Any]) -> GenerateSpec:
    if model is CompletionRequest:
        (spec, *_) = from_completion(CompletionRequest.model_validate(body), Settings(), {}, KNOWN)
    else:
        spec = from_chat(ChatCompletionRequest.model_validate(body), Settings(), {}, KNOWN)
    return dataclasses.replace(spec, engine_id="")  # fresh per call, by design


CASES = [
    (CompletionRequest, {"prompt": "hi"}, COMPLETION),
    (ChatCompletionRequest, {"messages": USER}, CHAT),
]


def test_both_endpoints_declare_the_common_fields() -> None:
    # An undeclared field is "unknown" and ignored (as OpenAI ignores them):
    # response_format on /v1/completions was, though vLLM honours it there.
    for model in (CompletionRequest, ChatCompletionRequest):
        declared = {info.alias or name for name, info in model.model_fields.items()}
        assert set(COMMON) <= declared, set(COMMON) - declared


@pytest.mark.parametrize(("model", "base", "samples"), CASES, ids=["completions", "chat"])
def test_every_field_is_honoured_or_refused(model, base, samples) -> None:
    refused = set(model.REFUSED)
    for name, info in model.model_fields.items():
        field = info.alias or name
        if field in INERT or field in SHAPE:
            continue
        if field in refused:
            for value in REFUSAL_PROBES:
                try:
                    _spec(model, {**base, field: value})
                except APIError as err:
                    assert err.param == field and err.status == 400, (field, err)
                    break
                except ValueError:  # a type this field's validator refuses: next probe
                    continue
            else:
                pytest.fail(f"{model.__name__}.{field}: no value is refused, none honoured")
            continue
        assert field in samples, f"{model.__name__}.{field}: honoured or refused? add a sample"
        value, companions = samples[field]
        before = _spec(model, {**base, **companions})
        after = _spec(model, {**base, **companions, field: value})
        assert after != before, f"{model.__name__}.{field} = {value!r} changed nothing"


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_shape_fields_reach_the_response(model) -> None:
    base = {"prompt": "hi"} if model is CompletionRequest else {"messages": USER}
    assert set(model.model_fields) & SHAPE == SHAPE
    body = model.model_validate({**base, "stream": True, "stream_options": {"include_usage": True}})
    assert body.stream and body.include_usage
    assert not model.model_validate({**base, "stream": True}).include_usage
    assert set(StreamOptions.model_fields) == {"include_usage", "continuous_usage_stats"}
    with pytest.raises(APIError) as err:
        _spec(model, {**base, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert err.value.param == "stream_options.continuous_usage_stats"


def test_every_structured_outputs_field_is_honoured_or_refused() -> None:
    samples = {
        "json_": {"type": "object"},
        "regex": "a+",
        "choice": ["a"],
        "grammar": 'start: "a"',
        "json_object": True,
    }
    refused = {"structural_tag": {"a": 1}, "whitespace_pattern": " "}
    assert set(StructuredOutputs.model_fields) == set(samples) | set(refused)
    for name, value in samples.items():
        field = StructuredOutputs.model_fields[name].alias or name
        spec = _spec(CompletionRequest, {"prompt": "hi", "structured_outputs": {field: value}})
        assert spec.structured is not None, field
    for field, value in refused.items():
        with pytest.raises(APIError) as err:
            _spec(CompletionRequest, {"prompt": "hi", "structured_outputs": {field: value}})
        assert err.value.param == f"structured_outputs.{field}"
