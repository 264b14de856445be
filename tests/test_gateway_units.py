"""Gateway pieces that need no server: request building, SLO metrics maths, OpenAI
formatting, API keys, and the router's choice among units."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from adaserve.config import Settings
from adaserve.request import TokenLogprobs
from adaserve.rpc.v1 import verifier_pb2 as vpb
from gateway.auth import ApiKeys
from gateway.core import Chunk, PromptScores
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics, RequestTimes
from gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
from gateway.responses import Formatter, sse
from gateway.router import Router, Unit
from gateway.spec import from_chat, from_completion

KNOWN = {"coding", "chat", "summarize"}


def _completion(headers: dict | None = None, **body: object):
    req = CompletionRequest.model_validate({"prompt": "hi", **body})
    (spec,) = from_completion(req, Settings(), headers or {}, KNOWN)
    return spec


def test_completion_defaults_follow_openai() -> None:
    spec = _completion()
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.top_k) == (16, 1.0, 1.0, 0)
    pb = spec.to_pb()
    assert pb.WhichOneof("prompt") == "text" and pb.text == "hi"
    assert pb.tpot_slo_ms == 0 and pb.slo_class == ""  # the verifier's default class
    assert spec.response_id == f"cmpl-{spec.engine_id}"


def test_slo_precedence_body_over_header() -> None:
    assert _completion({"x-slo-tpot-ms": "80"}).tpot_slo_ms == 80.0
    spec = _completion({"x-slo-tpot-ms": "80"}, tpot_slo_ms=30)
    assert spec.tpot_slo_ms == 30.0 and spec.metrics_class == "custom"
    spec = _completion({"x-slo-tpot-ms": "80"}, slo_class="coding")
    assert spec.tpot_slo_ms is None and spec.to_pb().slo_class == "coding"


def test_request_id_is_echoed_but_engine_ids_stay_unique() -> None:
    a, b = _completion(request_id="abc-1"), _completion(request_id="abc-1")
    assert a.response_id == b.response_id == "cmpl-abc-1"
    assert a.engine_id != b.engine_id
    assert _completion({"x-request-id": "hdr.7"}).response_id == "cmpl-hdr.7"


def test_chat_spec_flattens_parts_and_maps_developer_role() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "stop": "END",
            "top_k": -1,
        }
    )
    spec = from_chat(req, Settings(), {}, KNOWN)
    assert [(m.role, m.content) for m in spec.messages] == [("system", "be brief"), ("user", "ab")]
    assert (spec.max_tokens, spec.stop, spec.top_k) == (7, ("END",), 0)
    pb = spec.to_pb()
    assert pb.chat.add_generation_prompt and len(pb.chat.messages) == 2
    # No limit given: 0 asks the verifier for the rest of the context.
    bare = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert from_chat(bare, Settings(), {}, KNOWN).max_tokens == 0


def test_token_id_prompt() -> None:
    pb = _completion(prompt=[[5, 6, 7]]).to_pb()
    assert list(pb.token_ids.ids) == [5, 6, 7]


def test_slo_attainment_follows_the_design_definition() -> None:
    t = RequestTimes(t_submit=0.0)
    for now in (1.0, 1.05, 1.10, 1.20):  # 4 tokens over 200 ms: 66.7 ms per token
        t.on_tokens(now, 1)
    assert t.tpot_s == pytest.approx(0.2 / 3)
    assert t.attained(70.0) and not t.attained(60.0)
    one = RequestTimes(t_submit=0.0)
    one.on_tokens(0.5, 1)
    assert one.tpot_s is None and one.attained(1.0)  # nothing to violate


def test_metrics_goodput_and_attainment() -> None:
    m = GatewayMetrics()
    fast, slow = RequestTimes(0.0), RequestTimes(0.0)
    fast.on_tokens(0.1, 1)
    fast.on_tokens(0.2, 10)  # 11 tokens, 10 ms each
    slow.on_tokens(0.1, 1)
    slow.on_tokens(1.1, 1)  # 1 s per token
    m.finished("chat", 50.0, fast, 0.3, num_prompt_tokens=4, best_effort=False)
    m.finished("chat", 50.0, slow, 1.2, num_prompt_tokens=4, best_effort=False)
    text = m.render().decode()
    assert 'adaserve_gateway_goodput_tokens_total{slo_class="chat"} 11.0' in text
    assert 'adaserve_gateway_slo_attainment_ratio{slo_class="chat"} 0.5' in text
    assert 'adaserve_gateway_generation_tokens_total{slo_class="chat"} 13.0' in text


def test_chat_stream_format() -> None:
    f = Formatter("chat", "chatcmpl-1", "m", include_usage=True)
    assert f.chunk(Chunk((7,), "", None, 3, 1)) is None  # text held back: nothing to send
    # No empty opening chunk: the role rides with the first text, as vLLM sends it.
    first = f.chunk(Chunk((1, 2), "he", None, 3, 3))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "he"}
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    mid = f.chunk(Chunk((3,), "y", None, 3, 4))
    assert mid["choices"][0]["delta"] == {"content": "y"}
    assert f.chunk(Chunk((3,), "", None, 3, 3)) is None
    last = f.chunk(Chunk((), "", "stop", 3, 3))
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    usage = f.usage_chunk(3, 3)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6
    # A stream whose only frame is the finish still names the role.
    empty = Formatter("chat", "chatcmpl-2", "m", include_usage=False)
    assert empty.chunk(Chunk((), "", "stop", 3, 0))["choices"][0]["delta"] == {"role": "assistant"}
    frame = sse(mid)
    assert frame.startswith("data: {") and frame.endswith("}\n\n")
    assert json.loads(frame[len("data: ") :]) == mid


def test_completion_full_format() -> None:
    f = Formatter("completion", "cmpl-9", "m", include_usage=False)
    f.add(Chunk((1, 2), "ab", None, 2, 2))
    f.add(Chunk((3,), "c", "length", 2, 3))
    f.add(Chunk((4,), "x", "stop", 2, 1, index=1))
    body = f.full(2)
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"},
        {"index": 1, "text": "x", "logprobs": None, "finish_reason": "stop"},
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def _lp(logprobs: list[float], top: list[list[tuple[int, float]]]) -> TokenLogprobs:
    return TokenLogprobs(
        np.array(logprobs, np.float32),
        np.array([[t for t, _ in row] for row in top], np.int32).reshape(len(top), -1),
        np.array([[v for _, v in row] for row in top], np.float32).reshape(len(top), -1),
    )


PIECES = {1: "He", 2: "llo", 3: " w", 9: "Hi", 8: "lo"}


def test_chat_logprobs_format_and_held_back_tokens() -> None:
    """OpenAI's chat shape; a token whose text is held back keeps its entry until its
    choice's next frame, so every entry is sent once and in order."""
    f = Formatter("chat", "chatcmpl-1", "m", include_usage=False, logprobs=True)
    lp1 = _lp([-0.5], [[(1, -0.5), (9, -1.5)]])
    assert f.chunk(Chunk((1,), "", None, 3, 1, logprobs=lp1, pieces=PIECES)) is None
    lp2 = _lp([-0.25, -2.0], [[(2, -0.25), (8, -3.0)], [(3, -2.0), (1, -2.5)]])
    frame = f.chunk(Chunk((2, 3), "Hello w", "length", 3, 3, logprobs=lp2, pieces=PIECES))
    content = frame["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["He", "llo", " w"]
    assert content[0] == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]},
        ],
    }
    ids = Formatter("chat", "c", "m", False, logprobs=True, tokens_as_ids=True)
    frame = ids.chunk(Chunk((1,), "He", "stop", 3, 1, logprobs=lp1, pieces=PIECES))
    assert frame["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:1"


def test_completion_logprobs_format_with_echo() -> None:
    f = Formatter("completion", "cmpl-1", "m", include_usage=False, logprobs=True)
    f.prefix(0, "Say")
    lp = _lp([-0.5, -0.25], [[(1, -0.5)], [(2, -0.25)]])
    f.add(Chunk((1, 2), "Hello", "length", 3, 2, logprobs=lp, pieces=PIECES))
    (choice,) = f.full(3)["choices"]
    assert choice["text"] == "SayHello"
    assert choice["logprobs"] == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"He": -0.5}, {"llo": -0.25}],
        "text_offset": [3, 5],
    }


def test_echo_with_prompt_logprobs_and_vllms_field() -> None:
    """The echoed prompt's entries come first (the first token's logprob and
    top_logprobs null), then the output's; vLLM's prompt_logprobs keeps the prompt's
    token and the top k with their ranks; -inf is sent as -9999 (JSON has no infinity)."""
    scores = PromptScores(
        (9, 8, 1),
        TokenLogprobs(
            np.array([-1.5, -np.inf], np.float32),
            np.array([[3, 8], [1, 2]], np.int32),
            np.array([[-0.5, -1.5], [-np.inf, -np.inf]], np.float32),
            np.array([2, 1], np.int32),
        ),
        PIECES,
    )
    f = Formatter("completion", "cmpl-1", "m", include_usage=False, logprobs=True)
    f.prefix(0, "HiloHe", scores, k=1)
    lp = _lp([-0.25], [[(2, -0.25)]])
    f.add(Chunk((2,), "llo", "length", 3, 1, logprobs=lp, pieces=PIECES))
    f.set_prompt_logprobs(0, scores, 1)
    (choice,) = f.full(3)["choices"]
    assert choice["text"] == "HiloHello"
    assert choice["logprobs"] == {
        "tokens": ["Hi", "lo", "He", "llo"],
        "token_logprobs": [None, -1.5, -9999.0, -0.25],
        "top_logprobs": [None, {" w": -0.5}, {"He": -9999.0}, {"llo": -0.25}],
        "text_offset": [0, 2, 4, 6],
    }
    assert choice["prompt_logprobs"] == [
        None,
        {
            "8": {"logprob": -1.5, "rank": 2, "decoded_token": "lo"},
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": " w"},
        },
        {"1": {"logprob": -9999.0, "rank": 1, "decoded_token": "He"}},
    ]
    # Streamed: the echo frame carries the prompt's entries.
    s = Formatter("completion", "cmpl-1", "m", include_usage=False, logprobs=True)
    frame = s.text_frame(0, "HiloHe", scores, k=2)
    assert frame["choices"][0]["logprobs"]["tokens"] == ["Hi", "lo", "He"]
    assert frame["choices"][0]["logprobs"]["top_logprobs"][1] == {" w": -0.5, "lo": -1.5}


def test_api_keys() -> None:
    keys = ApiKeys(["sk-a", "sk-b", ""])
    keys.check("Bearer sk-b")
    keys.check("bearer sk-a")
    for bad in (None, "", "Bearer", "Bearer sk-c", "Token sk-a", "Bearer sk-a2"):
        with pytest.raises(APIError) as info:
            keys.check(bad)
        assert info.value.status == 401
    assert not keys.requires_auth("/health", True)
    assert keys.requires_auth("/metrics", True) and not keys.requires_auth("/metrics", False)
    ApiKeys([]).check(None)  # no keys configured: open


def test_router_picks_least_outstanding_healthy_unit() -> None:
    async def scenario() -> None:
        router = Router(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
        for addr in router.static:  # connect without a health round (nothing listens)
            router.units[addr] = Unit.connect(addr)
        a, b, c = router.units.values()
        for u, name in ((a, "m"), (b, "m"), (c, "other")):
            u.healthy, u.info = True, vpb.InfoResponse(served_model_name=name)
        a.outstanding, b.outstanding = 3, 1
        assert router.pick("m") is b
        assert router.pick(None) is c  # zero outstanding
        b.healthy = False
        assert router.pick("m") is a
        with pytest.raises(APIError) as gone:  # the only unit serving m already failed
            router.pick("m", exclude=frozenset({a.address}))
        assert gone.value.status == 503
        with pytest.raises(APIError) as info:
            router.pick("nope")
        assert info.value.status == 404 and info.value.body() == {
            "error": {
                "message": "The model `nope` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
        assert info.value.grpc_code == grpc.StatusCode.NOT_FOUND
        # Ties rotate rather than always hitting the first unit.
        b.healthy, b.outstanding, a.outstanding = True, 0, 0
        assert {router.pick("m").address for _ in range(4)} == {a.address, b.address}
        for u in (a, b, c):
            u.healthy = False
        with pytest.raises(APIError) as none:
            router.pick("m")
        assert none.value.status == 503
        await router.close()

    asyncio.run(scenario())


def test_completion_response_format_is_a_grammar_as_on_chat() -> None:
    # It was parsed as an unknown field and dropped: the output was free text.
    spec = _completion(response_format={"type": "json_object"})
    assert spec.structured is not None and spec.structured.kind == "json_object"
    assert spec.to_pb().sampling.HasField("structured_output")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = _completion(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert spec.structured is not None and json.loads(str(spec.structured.value)) == schema
    with pytest.raises(APIError) as err:
        _completion(response_format={"type": "json_object"}, guided_regex="a")
    assert err.value.param in ("guided_regex", "response_format")
    assert _completion(response_format={"type": "text"}).structured is None
