"""Tools through the official `openai` package against a real gateway: a round trip
(the call, the tool's result, the answer), streamed and not, with a named and a
required tool choice (grammar-constrained, so the same with speculation as without),
for a template without tools of its own (SmolLM2's kind: the tools are described in a
system message) and one that renders them itself (Qwen2.5's Hermes format)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests._serving import TEST_CONFIG, Proc, make_served_model, start_gateway, start_verifier
from tests._templates import QWEN_LIKE

pytestmark = pytest.mark.slow  # four serving processes

UNIT = TEST_CONFIG + "scheduler:\n  budget: 16\n  adaptive: {d_min: 2, d_max: 4, w_max: 2}\n"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "local"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One gateway, three units: `tiny` (ChatML without tools, drafting for itself),
    `tiny-plain` (the same, no drafter) and `tiny-qwen` (a Hermes template)."""
    root = tmp_path_factory.mktemp("tools")
    # Characters are tokens here: a prompt describing two tools is ~700 of them.
    chatml = make_served_model(root / "chatml", seed=0, max_position_embeddings=2048)
    qwen = make_served_model(
        root / "qwen", seed=0, chat_template=QWEN_LIKE, max_position_embeddings=2048
    )
    procs: list[Proc] = []
    addrs = []
    try:
        for name, target, drafter in (
            ("tiny", chatml, chatml),
            ("tiny-plain", chatml, None),
            ("tiny-qwen", qwen, qwen),
        ):
            v, addr = start_verifier(root, target, drafter, UNIT, name=name, served_name=name)
            procs.append(v)
            addrs += ["--verifier", addr]
        g, gw = start_gateway(root, *addrs, wait_path="/ready")
        procs.append(g)
        yield gw
    finally:
        for p in reversed(procs):
            p.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _ask(client: openai.OpenAI, model: str, messages: list, stream: bool, **kw):
    """(content, [(name, arguments)], finish_reason, the assistant message to send back)."""
    args = dict(model=model, messages=messages, max_tokens=80, temperature=0) | kw
    if not stream:
        out = client.chat.completions.create(**args)
        msg = out.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        return msg.content, calls, out.choices[0].finish_reason, msg.model_dump(exclude_none=True)
    content, calls, reason, ids = "", {}, None, {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                name, arguments = calls.get(tc.index, ("", ""))
                calls[tc.index] = (
                    name + (tc.function.name or ""),
                    arguments + (tc.function.arguments or ""),
                )
                ids[tc.index] = ids.get(tc.index) or tc.id
            reason = c.finish_reason or reason
    listed = [calls[i] for i in sorted(calls)]
    message = {
        "role": "assistant",
        "tool_calls": [
            {"id": ids[i], "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in zip(sorted(calls), listed, strict=True)
        ],
    }
    return content or None, listed, reason, message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", ["tiny", "tiny-qwen"])
def test_round_trip_call_result_answer(url: str, model: str, stream: bool) -> None:
    client = _client(url)
    tools = [WEATHER, CLOCK]
    content, calls, reason, message = _ask(
        client, model, QUESTION, stream, tools=tools, tool_choice=NAMED
    )
    assert reason == "tool_calls" and content is None
    ((name, arguments),) = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    if model == "tiny":  # the same call with speculation as without
        plain = _ask(client, "tiny-plain", QUESTION, stream, tools=tools, tool_choice=NAMED)
        assert plain[1] == calls
    history = [
        *QUESTION,
        message,
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "18 C"},
    ]
    answer, calls, reason, _ = _ask(client, model, history, stream, tools=tools, tool_choice="none")
    assert calls == [] and reason in ("stop", "length") and answer
    if model == "tiny":
        plain = _ask(client, "tiny-plain", history, stream, tools=tools, tool_choice="none")
        assert plain[0] == answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_calls_validate_and_match_plain_decoding(url: str, stream: bool) -> None:
    """Greedy and sampled, one call (a random model allowed parallel calls keeps adding
    them past max_tokens: the list's grammar is unbounded, as OpenAI's; the parsing of
    several calls is tested on its own)."""
    client = _client(url)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=1.0, seed=4)):
        kw |= dict(
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            max_tokens=200,
            parallel_tool_calls=False,
        )
        _, calls, reason, _ = _ask(client, "tiny", QUESTION, stream, **kw)
        assert reason == "tool_calls" and len(calls) == 1, kw
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
        assert _ask(client, "tiny-plain", QUESTION, stream, **kw)[1] == calls


def test_auto_answers_in_text_or_calls(url: str) -> None:
    """auto: the model chooses. The tiny random model writes no Hermes call, so this is
    plain content with its own finish reason; the parsers are tested on their own."""
    content, calls, reason, _ = _ask(_client(url), "tiny", QUESTION, False, tools=[WEATHER])
    assert (calls == [] and content and reason in ("stop", "length")) or reason == "tool_calls"


def test_bad_tool_input_is_400(url: str) -> None:
    client = _client(url)
    bad = [
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
        dict(tools=[{"type": "retrieval"}]),
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, **kw)
        assert "tool" in info.value.message, info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # a tool message answers a call
        client.chat.completions.create(
            model="tiny", messages=[*QUESTION, {"role": "tool", "content": "x"}], max_tokens=4
        )
    assert "tool_call_id" in info.value.message
