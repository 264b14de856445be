"""Tools without a server: rendering through each family's chat template (tools, the
assistant's calls, the results) and the tool-call format it implies; parsing each
format whole and streamed; the grammar a required or named call is held to."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from adaserve.chat import render, tool_call_format
from gateway.openai_schemas import ChatCompletionRequest
from gateway.tools import ToolStream, parse, plan
from tests._serving import make_served_model
from tests._templates import LLAMA_LIKE, MISTRAL_LIKE, QWEN_LIKE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
]


def _plan(**body: object):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME], **body}
    )
    tp = plan(req)
    assert tp is not None
    return tp


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("templates")
    out = {}
    for name, template in (
        ("chatml", None),
        ("qwen", QWEN_LIKE),
        ("llama", LLAMA_LIKE),
        ("mistral", MISTRAL_LIKE),
    ):
        kw = {} if template is None else {"chat_template": template}
        out[name] = AutoTokenizer.from_pretrained(make_served_model(Path(root / name), **kw))
    return out


@pytest.mark.parametrize(
    ("name", "fmt", "call", "result"),
    [
        (
            "chatml",
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
            "<tool_response>\n18 C, sunny\n</tool_response>",
        ),
        (
            "qwen",
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
            "<tool_response>\n18 C, sunny\n</tool_response>",
        ),
        (
            "llama",
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "<|im_start|>ipython\n18 C, sunny",
        ),
        (
            "mistral",
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "[TOOL_RESULTS]18 C, sunny[/TOOL_RESULTS]",
        ),
    ],
)
def test_each_family_renders_tools_calls_and_results(tokenizers, name, fmt, call, result) -> None:
    tok = tokenizers[name]
    assert tool_call_format(tok) == fmt
    text = tok.decode(render(tok, CONVERSATION, [WEATHER, TIME]), skip_special_tokens=False)
    assert call in text and result in text, text
    assert "Weather in a city" in text and "get_time" in text  # the tools are described
    if name in ("chatml", "qwen"):  # the system prompt is kept beside the tools
        assert "Be brief." in text
    # Without tools and calls, rendering is the template's plain chat.
    plain = [m for m in CONVERSATION if m["role"] in ("system", "user")]
    assert "get_weather" not in tok.decode(render(tok, plain), skip_special_tokens=False)


def test_parse_each_format() -> None:
    tp = _plan()
    content, calls = parse(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        tp,
        "hermes",
    )
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    _, calls = parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_time", "parameters": {}}',
        tp,
        "llama3_json",
    )
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    _, calls = parse('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', tp, "mistral")
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    # Not calls: unknown tools, broken JSON, plain text stay content.
    for text, fmt in [
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "hermes"),
        ('<tool_call>{"name": "get_time", </tool_call>', "hermes"),
        ("{not json", "llama3_json"),
        ("Sunny.", "mistral"),
    ]:
        assert parse(text, tp, fmt) == (text, [])
    # parallel_tool_calls false: one call at most.
    one = _plan(parallel_tool_calls=False)
    assert (
        len(
            parse(
                '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2, one, "hermes"
            )[1]
        )
        == 1
    )


@pytest.mark.parametrize(
    ("fmt", "pieces", "content", "names"),
    [
        (
            "hermes",
            [
                "Sure",
                ". <tool",
                "_call>\n",
                '{"name": "get_time", "arguments": {}}',
                "\n</tool_call>",
            ],
            "Sure. ",
            ["get_time"],
        ),
        ("hermes", ["a <tool", "box> b"], "a <toolbox> b", []),
        ("llama3_json", [" {", '"name": "get_time", "parameters": {}}'], "", ["get_time"]),
        ("llama3_json", ["It is", " {warm}"], "It is {warm}", []),
        (
            "mistral",
            ["[TOOL", "_CALLS]", '[{"name": "get_time", "arguments": {}}]'],
            "",
            ["get_time"],
        ),
        ("mistral", ["Hello ", "[TOOL_CALLS] oops"], "Hello [TOOL_CALLS] oops", []),
    ],
)
def test_streamed_text_is_content_until_a_call_begins(fmt, pieces, content, names) -> None:
    stream = ToolStream(_plan(), fmt)
    released = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    assert released + rest == content
    assert [c["function"]["name"] for c in calls] == names
    if names and fmt == "hermes":  # the marker never reached the client as content
        assert "<tool" not in released


def test_required_and_named_calls_are_schemas() -> None:
    required = _plan(tool_choice="required").schema()
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], required)
    jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "nope", "parameters": {}}], required)
    single = _plan(tool_choice="required", parallel_tool_calls=False).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    named = _plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.schema() == WEATHER["function"]["parameters"]
    _, calls = parse('{"city": "Lima"}', named, "hermes")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    _, calls = parse(
        '[{"name": "get_time", "parameters": {}}]', _plan(tool_choice="required"), "mistral"
    )
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_a_required_array_cut_by_length_keeps_its_complete_calls() -> None:
    # A length cut inside the second call: the first, complete, is a tool call (it came
    # back as content before, the whole array unparsed), whole and streamed.
    required = _plan(tool_choice="required")
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    content, calls = parse(text, required, "hermes")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    stream = ToolStream(required, "hermes")
    assert stream.feed(text[:30]) == "" and stream.feed(text[30:]) == ""
    rest, streamed = stream.finish()
    assert rest == "" and [c["function"] for c in streamed] == [calls[0]["function"]]
    # Nothing complete yet: the text stays content, nothing is invented.
    assert parse('[{"name": "get_ti', required, "hermes") == ('[{"name": "get_ti', [])
