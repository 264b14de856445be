"""End to end through the official `openai` package: a gateway process in front of a
verifier process (tiny random target, in-process tiny drafter, real tokenizer and chat
template). Greedy outputs equal the target's own greedy output (Hugging Face as the
oracle), streams deliver every token once and in order, usage is right, mixed SLOs run
concurrently, a vanished client frees the request's state, and the gRPC front serves
the same API."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from adaserve.rpc.v1 import gateway_pb2 as gpb
from adaserve.rpc.v1 import gateway_pb2_grpc as ggrpc
from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from tests._serving import (
    IM_END,
    TEST_CONFIG,
    Proc,
    free_port,
    greedy_reference,
    make_served_model,
    start_gateway,
    start_verifier,
    wait_http,
)

pytestmark = pytest.mark.slow  # two serving processes per module


@dataclass
class Stack:
    url: str  # gateway base URL
    grpc_address: str  # gateway gRPC front
    verifier: vgrpc.VerifierStub
    verifier_proc: Proc
    verifier_metrics: str  # the engine's Prometheus endpoint
    target: Path
    tokenizer: object

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, **kw)

    def reference(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        return greedy_reference(self.target, prompt_ids, max_tokens)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def wait_idle(self, timeout: float = 10.0) -> vpb.VerifierStatsResponse:
        deadline = time.monotonic() + timeout
        while True:
            s = self.verifier.Stats(vpb.VerifierStatsRequest())
            if (s.num_requests == 0 and s.kv_usage == 0.0) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("e2e")
    target = make_served_model(root / "target", seed=0)
    drafter = make_served_model(root / "drafter", seed=1)
    metrics_port = free_port()
    # The default classes, two of them with a TTFT SLO too.
    config = TEST_CONFIG + (
        "  classes:\n"
        "    coding: {baseline_scale: 1.2, ttft_ms: 800}\n"
        "    chat: {tpot_ms: 50}\n"
        "    summarize: {tpot_ms: 150, ttft_ms: 20000}\n"
    )
    vproc, vaddr = start_verifier(root, target, drafter, config, metrics_port=metrics_port)
    gport = free_port()
    cfg = root / "gateway.yaml"
    cfg.write_text("gateway:\n  health_interval_s: 0.5\n")
    try:
        gproc, url = start_gateway(
            root, "--verifier", vaddr, "--config", str(cfg), grpc_port=gport, wait_path="/ready"
        )
    except BaseException:
        vproc.stop()
        raise
    try:
        with grpc.insecure_channel(vaddr) as channel:
            yield Stack(
                url,
                f"127.0.0.1:{gport}",
                vgrpc.VerifierStub(channel),
                vproc,
                f"http://127.0.0.1:{metrics_port}/metrics",
                target,
                AutoTokenizer.from_pretrained(target),
            )
    finally:
        gproc.stop()
        vproc.stop()


def _finish(ref: list[int]) -> str:
    return "stop" if ref and ref[-1] == IM_END else "length"


def test_models(stack: Stack) -> None:
    models = stack.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    # What the weights run as (model.quantization): a Hugging Face directory's are float32.
    (model,) = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
    assert model["quantization"] == "none"
    # OpenAI's retrieval: the list's entry, and a 404 in OpenAI's shape for another name.
    one = stack.client().models.retrieve("tiny")
    assert one.id == "tiny" and one.model_dump(exclude_unset=True) == model
    with pytest.raises(openai.NotFoundError) as missing:
        stack.client().models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    assert missing.value.body["param"] == "model"


def test_slo_contract_is_published(stack: Stack) -> None:
    """GET /v1/slo shows per unit the baseline (20 ms in the test config), what each
    class resolved to (the built-in classes: coding 1.2x baseline, chat 50 ms, summarize
    150 ms), the default class and the floor; /v1/models carries the same per model."""
    (unit,) = httpx.get(f"{stack.url}/v1/slo", timeout=10).json()["data"]
    assert unit["model"] == "tiny" and unit["unit"].startswith("127.0.0.1:")
    assert unit["baseline_tpot_ms"] == 20.0 and unit["default_class"] == "chat"
    assert unit["classes"] == {
        "coding": {"tpot_ms": 24.0, "ttft_ms": 800.0},
        "chat": {"tpot_ms": 50.0},
        "summarize": {"tpot_ms": 150.0, "ttft_ms": 20000.0},
    }
    assert unit["speculative"] is True
    assert unit["baseline"] == {"source": "configured"}  # the test config sets 20 ms
    # A tiny model's 1-token step is far under the 21 ms (baseline x correction) the
    # predictor starts from; speculation can only lower the floor further.
    assert 0 < unit["slo_floor_ms"] <= 21.0
    (model,) = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
    expected = {k: v for k, v in unit.items() if k not in ("model", "unit", "slo_floor_ms")}
    assert {k: v for k, v in model["slo"].items() if k != "slo_floor_ms"} == expected
    assert model["slo"]["slo_floor_ms"] > 0


def test_completion_greedy_equals_target(stack: Stack) -> None:
    prompt = "Once upon a time"
    out = stack.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=0
    )
    ids = stack.tokenizer.encode(prompt)
    ref = stack.reference(ids, 30)
    assert out.choices[0].text == stack.text(ref)
    assert out.choices[0].finish_reason == _finish(ref)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(ref)
    assert out.usage.total_tokens == len(ids) + len(ref)


def test_chat_greedy_equals_target(stack: Stack) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    out = stack.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=25, temperature=0, seed=7
    )
    ids = stack.chat_ids(messages)
    ref = stack.reference(ids, 25)
    msg = out.choices[0].message
    assert (msg.role, msg.content) == ("assistant", stack.text(ref))
    assert out.choices[0].finish_reason == _finish(ref)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(ref))


def test_a_follow_up_turn_is_served_from_the_prefix_cache(stack: Stack) -> None:
    """A chat's second turn resends the first (system prompt, question, answer): the
    unit finds that history in its prefix cache and prefills only the new part, and the
    answer is still the target's own."""
    from tests._faults import metric

    system = {"role": "system", "content": "You answer questions about colours. " * 8}
    first = [system, {"role": "user", "content": "Name a colour."}]
    client = stack.client()
    out = client.chat.completions.create(model="tiny", messages=first, max_tokens=16, temperature=0)
    hits = metric(stack.verifier_metrics, "adaserve_prefix_cache_hits_total")
    second = [
        *first,
        {"role": "assistant", "content": out.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    out2 = client.chat.completions.create(
        model="tiny", messages=second, max_tokens=16, temperature=0
    )
    ids = stack.chat_ids(second)
    assert out2.choices[0].message.content == stack.text(stack.reference(ids, 16))
    gained = metric(stack.verifier_metrics, "adaserve_prefix_cache_hits_total") - hits
    # At least the system prompt and the first question, in whole 16-token blocks.
    assert gained >= 16 * (len(stack.chat_ids(first)) // 16 - 1)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_equals_non_streaming(stack: Stack, kind: str) -> None:
    client = stack.client()
    messages = [{"role": "user", "content": "Tell me a story."}]
    args = dict(model="tiny", max_tokens=40, temperature=0)
    if kind == "chat":
        whole = client.chat.completions.create(messages=messages, **args)
        stream = client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **args
        )
        expected = whole.choices[0].message.content
    else:
        whole = client.completions.create(prompt="Tell me a story.", **args)
        stream = client.completions.create(
            prompt="Tell me a story.",
            stream=True,
            stream_options={"include_usage": True},
            **args,
        )
        expected = whole.choices[0].text
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.model_dump() == whole.usage.model_dump()
    content = chunks[:-1]
    assert all(c.usage is None for c in content)
    if kind == "chat":
        assert content[0].choices[0].delta.role == "assistant"
        pieces = [c.choices[0].delta.content or "" for c in content]
    else:
        pieces = [c.choices[0].text for c in content]
    assert "".join(pieces) == expected
    reasons = [c.choices[0].finish_reason for c in content]
    assert reasons[-1] == whole.choices[0].finish_reason
    assert all(r is None for r in reasons[:-1])


def test_sse_wire_format(stack: Stack) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    for frame in frames[:-2]:
        assert frame.startswith("data: ")
        assert json.loads(frame[len("data: ") :])["object"] == "text_completion"


def _stream_frames(url: str, body: dict) -> tuple[httpx.Headers, list[dict]]:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        frames = [
            json.loads(line[len("data: ") :])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return r.headers, frames


def test_unattainable_slo_is_flagged_before_any_token_and_in_the_final_chunk(
    stack: Stack,
) -> None:
    """0.05 ms per token is below what this unit can give one request alone (its floor,
    reported with the request): the response header says so before the first token,
    and the final chunk's `slo` object carries the floor and the reason."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    headers, frames = _stream_frames(
        f"{stack.url}/v1/chat/completions", body | {"tpot_slo_ms": 0.05}
    )
    assert headers["x-slo-best-effort"] == "true"
    slo = frames[-1]["slo"]
    assert slo["best_effort"] is True and slo["tpot_slo_ms"] == 0.05
    assert slo["slo_floor_ms"] > 0.05 and "floor" in slo["reason"]
    assert all("slo" not in f for f in frames[:-1])
    headers, frames = _stream_frames(f"{stack.url}/v1/chat/completions", body)
    assert headers["x-slo-best-effort"] == "false"
    slo = frames[-1]["slo"]
    assert slo["best_effort"] is False and slo["reason"] is None
    assert slo["slo_class"] == "chat" and slo["tpot_slo_ms"] > slo["slo_floor_ms"] > 0
    # The gRPC front carries the same verdict in every chunk.
    with grpc.insecure_channel(stack.grpc_address) as ch:
        req = gpb.CompleteRequest(
            options=gpb.RequestOptions(model="tiny", max_tokens=3, tpot_slo_ms=0.05), text="x"
        )
        chunks = list(ggrpc.GatewayStub(ch).Complete(req, timeout=60))
    assert all(c.best_effort and "floor" in c.best_effort_reason for c in chunks)
    assert all(c.slo_floor_ms > 0.05 for c in chunks)


@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_first_sse_frame_carries_the_first_token(stack: Stack, kind: str) -> None:
    """No empty opening frame: a client timing the first byte of the body measures the
    real time to the first token. In chat, the role rides with the first text."""
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True}
    if kind == "chat/completions":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    _, frames = _stream_frames(f"{stack.url}/v1/{kind}", body)
    first = frames[0]["choices"][0]
    if kind == "chat/completions":
        assert first["delta"]["role"] == "assistant" and first["delta"]["content"]
        assert all("role" not in f["choices"][0]["delta"] for f in frames[1:])
    else:
        assert first["text"]


def test_grpc_front_streams_every_token_once_in_order(stack: Stack) -> None:
    ids = stack.tokenizer.encode("Hello there")
    ref = stack.reference(ids, 60)
    with grpc.insecure_channel(stack.grpc_address) as ch:
        stub = ggrpc.GatewayStub(ch)
        req = gpb.CompleteRequest(
            options=gpb.RequestOptions(
                model="tiny", max_tokens=60, temperature=0, request_id="grpc-1"
            ),
            token_ids=vpb.TokenIds(ids=ids),
        )
        chunks = list(stub.Complete(req, timeout=60))
        assert [t for c in chunks for t in c.token_ids] == ref
        assert {c.id for c in chunks} == {"cmpl-grpc-1"}
        last = chunks[-1]
        assert last.usage.completion_tokens == len(ref)
        assert last.finish_reason in (vpb.FINISH_REASON_STOP, vpb.FINISH_REASON_LENGTH)
        assert stub.ListModels(gpb.ListModelsRequest()).models == ["tiny"]

        chat = gpb.ChatCompleteRequest(
            options=gpb.RequestOptions(max_tokens=20, temperature=0),
            messages=[vpb.ChatMessage(role="user", content="Hi")],
        )
        got = [t for c in stub.ChatComplete(chat, timeout=60) for t in c.token_ids]
        assert got == stack.reference(stack.chat_ids([{"role": "user", "content": "Hi"}]), 20)

        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.Complete(
                    gpb.CompleteRequest(options=gpb.RequestOptions(model="nope"), text="x"),
                    timeout=10,
                )
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == "The model `nope` does not exist."
        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.Complete(
                    gpb.CompleteRequest(options=gpb.RequestOptions(max_tokens=-4), text="x"),
                    timeout=10,
                )
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _metric(stack: Stack, name: str, method: str) -> float:
    text = httpx.get(stack.verifier_metrics, timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{method="{method}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("method", ["auto", "model", "ngram", "none"])
def test_speculation_method_per_request_keeps_the_targets_output(stack: Stack, method) -> None:
    """The body field and the gRPC front's enum reach the engine: each method gives the
    target's own greedy output, and the per-method metrics count its steps."""
    messages = [{"role": "user", "content": "abc abc abc abc, say abc abc abc again"}]
    ref = stack.reference(stack.chat_ids(messages), 40)
    steps = "adaserve_spec_decode_method_steps_total"
    before = {m: _metric(stack, steps, m) for m in ("ngram", "none")}
    out = stack.client().chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=40,
        temperature=0,
        extra_body={"speculation": {"method": method}},
    )
    assert out.choices[0].message.content == stack.text(ref)
    if method in before:  # these two always verify under their own name
        assert _metric(stack, steps, method) >= before[method] + len(ref) // 8
    enum = getattr(vpb, f"SPECULATION_METHOD_{method.upper()}")
    with grpc.insecure_channel(stack.grpc_address) as ch:
        chat = gpb.ChatCompleteRequest(
            options=gpb.RequestOptions(max_tokens=40, temperature=0, speculation_method=enum),
            messages=[vpb.ChatMessage(**m) for m in messages],
        )
        got = [t for c in ggrpc.GatewayStub(ch).ChatComplete(chat, timeout=60) for t in c.token_ids]
    assert got == ref
    assert stack.wait_idle().num_requests == 0


def test_unavailable_or_unknown_speculation_method_is_refused(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().completions.create(
            model="tiny",
            prompt="abc",
            max_tokens=4,
            extra_body={"speculation": {"method": "eagle"}},
        )
    assert "speculation.method" in info.value.message and "not available" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().completions.create(
            model="tiny", prompt="abc", max_tokens=4, extra_body={"speculation": {"method": "x"}}
        )
    assert info.value.body["param"] == "speculation.method"
    with grpc.insecure_channel(stack.grpc_address) as ch, pytest.raises(grpc.RpcError) as err:
        req = gpb.CompleteRequest(options=gpb.RequestOptions(max_tokens=4), text="abc")
        req.options.speculation_method = 9  # type: ignore[assignment]
        list(ggrpc.GatewayStub(ch).Complete(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculation.method" in err.value.details()
    assert stack.wait_idle().num_requests == 0


def test_request_id_and_priority(stack: Stack) -> None:
    raw = stack.client().completions.with_raw_response.create(
        model="tiny", prompt="abc", max_tokens=3, extra_body={"request_id": "r-42", "priority": 5}
    )
    assert raw.headers["x-request-id"] == "r-42"
    assert raw.parse().id == "cmpl-r-42"


def test_bad_input_through_the_unit(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x" * 600, max_tokens=4)
    assert "context" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="abc", max_tokens=510)
    assert "context" in info.value.message
    # OpenAI's and vLLM's answer, on both endpoints.
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="abc")
    assert info.value.body == {
        "message": "The model `gpt-4` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "x"}], stream=True
        )
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="")
    assert stack.wait_idle().num_requests == 0


def test_mixed_slo_batch_completes_concurrently(stack: Stack) -> None:
    cases = [
        ("coding", {"extra_body": {"slo_class": "coding"}}, 16),
        ("chat", {"extra_body": {"slo_class": "chat"}}, 6),
        ("summarize", {"extra_body": {"slo_class": "summarize"}}, 24),
        ("custom", {"extra_body": {"tpot_slo_ms": 35.5}}, 10),
        ("custom", {"extra_headers": {"x-slo-tpot-ms": "90"}}, 12),
        ("chat", {}, 20),  # the default class
    ]
    prompts = [f"Request number {i}:" for i in range(len(cases))]

    async def run_all() -> list:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)
        calls = [
            client.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=n,
                temperature=0,
                extra_body={"ignore_eos": True, **kw.get("extra_body", {})},
                extra_headers=kw.get("extra_headers"),
            )
            for p, (_, kw, n) in zip(prompts, cases, strict=True)
        ]
        return await asyncio.gather(*calls)

    before = _batched_iterations(stack)
    outs = asyncio.run(run_all())
    # The engine's own count: iterations whose decode batch held more than one request.
    assert _batched_iterations(stack) > before, "requests did not share the decode batch"
    for p, (_, _, n), out in zip(prompts, cases, outs, strict=True):
        ids = stack.tokenizer.encode(p)
        assert out.usage.completion_tokens == n
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].text == stack.text(greedy_reference_ignoring_eos(stack, ids, n))
    metrics = httpx.get(f"{stack.url}/metrics").text
    for cls in ("coding", "chat", "summarize", "custom"):
        assert f'adaserve_gateway_slo_requests_total{{slo_class="{cls}"}}' in metrics


def test_ttft_slo_from_body_header_and_class(stack: Stack) -> None:
    """A TTFT SLO comes from the body field, else the x-slo-ttft-ms header, else the
    class's own; the response's slo object reports it (streamed: on the last chunk),
    and the output is the target's own."""
    cases = [
        ({"extra_body": {"ttft_slo_ms": 1234.5}}, 1234.5),
        ({"extra_headers": {"x-slo-ttft-ms": "2500"}}, 2500.0),
        ({"extra_body": {"slo_class": "coding"}}, 800.0),
        ({"extra_body": {"slo_class": "coding", "ttft_slo_ms": 99.0}}, 99.0),
        ({"extra_body": {"tpot_slo_ms": 70.0}}, None),
        ({}, None),  # the default class, chat, has none
    ]
    client = stack.client()
    ids = stack.tokenizer.encode("Time to first token:")
    ref = stack.text(greedy_reference_ignoring_eos(stack, ids, 8))
    for kw, want in cases:
        extra_body = {"ignore_eos": True, **kw.get("extra_body", {})}
        headers = kw.get("extra_headers")
        out = client.completions.create(
            model="tiny",
            prompt="Time to first token:",
            max_tokens=8,
            temperature=0,
            extra_body=extra_body,
            extra_headers=headers,
        )
        assert out.choices[0].text == ref
        assert (out.model_extra or {})["slo"]["ttft_slo_ms"] == want, kw
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt="Time to first token:",
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_body=extra_body,
                extra_headers=headers,
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
        last = [c for c in chunks if (c.model_extra or {}).get("slo")][-1]
        assert last.model_extra["slo"]["ttft_slo_ms"] == want, kw
    metrics = httpx.get(stack.verifier_metrics).text
    assert 'adaserve_engine_ttft_slo_total{outcome="attained",slo_class="coding"}' in metrics


def _batched_iterations(stack: Stack) -> float:
    values = {}
    for line in httpx.get(stack.verifier_metrics).text.splitlines():
        if line.startswith("adaserve_batch_size_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values["adaserve_batch_size_count"] - values['adaserve_batch_size_bucket{le="1.0"}']


def greedy_reference_ignoring_eos(stack: Stack, ids: list[int], n: int) -> list[int]:
    """ignore_eos: the target's greedy tokens, eos included as an ordinary token."""
    import torch

    from tests._serving import _hf_model

    model = _hf_model(str(stack.target))
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(torch.argmax(model(torch.tensor([seq])).logits[0, -1]))
            out.append(tok)
            seq.append(tok)
    return out


# A fast host can finish 480 tokens of the tiny model inside a short timeout (a CI host
# finished one inside a 1 s deadline): the timeout tests shrink theirs until one expires.
TIMEOUTS_S = (0.3, 0.1, 0.03, 0.01, 0.003)


def _first_expiring(attempt: Callable[[float], bool]) -> float:
    """Calls attempt(t) with shrinking timeouts until it reports that t expired; returns
    that t. An attempt whose request finished first must have left nothing behind."""
    for t in TIMEOUTS_S:
        if attempt(t):
            return t
    raise AssertionError(f"480 tokens finished inside every timeout of {TIMEOUTS_S}")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_state(stack: Stack, stream: bool) -> None:
    body = {
        "model": "tiny",
        "prompt": "Go on and on",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"{stack.url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                assert stack.verifier.Stats(vpb.VerifierStatsRequest()).num_requests == 1
        else:  # a non-streaming client that gives up

            def gives_up(t: float) -> bool:
                try:
                    http.post(f"{stack.url}/v1/completions", json=body, timeout=t + 0.2)
                except httpx.ReadTimeout:
                    return True
                return False

            _first_expiring(gives_up)
    stats = stack.wait_idle()
    assert (stats.num_requests, stats.running, stats.kv_usage) == (0, 0, 0.0)
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert "adaserve_gateway_requests_in_flight 0.0" in metrics


def test_timeout_is_an_openai_error(stack: Stack) -> None:
    """OpenAI clients know no finish_reason "timeout": a request past its deadline is a
    408 in OpenAI's error shape, or, once streaming, an error frame (the client raises)
    and no [DONE]. Its state is freed either way."""

    def kw(t: float) -> dict:
        return dict(
            model="tiny",
            prompt="slow",
            max_tokens=480,
            temperature=0,
            extra_body={"ignore_eos": True, "timeout": t},
        )

    caught: dict[str, openai.APIError] = {}

    def plain(t: float) -> bool:
        try:
            stack.client().completions.create(**kw(t))
        except openai.APIStatusError as exc:
            caught["plain"] = exc
            return True
        return False

    def streamed(t: float) -> bool:
        try:
            for _ in stack.client().completions.create(stream=True, **kw(t)):
                pass
        except openai.APIError as exc:
            caught["stream"] = exc
            return True
        return False

    _first_expiring(plain)
    info = caught["plain"]
    assert isinstance(info, openai.APIStatusError) and info.status_code == 408
    assert isinstance(info.body, dict)
    assert info.body["code"] == "timeout" and info.body["param"] == "timeout"
    assert stack.wait_idle().num_requests == 0
    _first_expiring(streamed)
    assert "timed out" in caught["stream"].message
    body = {"model": "tiny", "prompt": "slow", "max_tokens": 480, "ignore_eos": True}
    frames: list[dict] = []

    def raw(t: float) -> bool:
        nonlocal frames
        _, frames = _stream_frames(
            f"{stack.url}/v1/completions", body | {"stream": True, "timeout": t}
        )
        return "error" in frames[-1]

    _first_expiring(raw)
    assert frames[-1]["error"]["code"] == "timeout"
    assert all(f.get("choices", [{}])[0].get("finish_reason") in (None,) for f in frames[:-1])
    assert stack.wait_idle().num_requests == 0


def test_engine_full_is_429_with_retry_after(stack: Stack) -> None:
    body = {
        "model": "tiny",
        "prompt": "busy",
        "max_tokens": 480,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    async def flood() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as http:
            streams = [
                http.stream("POST", f"{stack.url}/v1/completions", json=body) for _ in range(24)
            ]
            responses = [await s.__aenter__() for s in streams]
            codes = [r.status_code for r in responses]
            for r in responses:
                if r.status_code == 429:
                    assert int(r.headers["retry-after"]) >= 1
                    assert json.loads(await r.aread())["error"]["type"] == "rate_limit_error"
            for s in streams:
                await s.__aexit__(None, None, None)
            return codes

    codes = asyncio.run(flood())
    assert 429 in codes and codes.count(200) >= 8
    assert stack.wait_idle().num_requests == 0


def test_unit_dropped_and_readmitted(stack: Stack) -> None:
    """A unit that stops answering health checks is dropped (503, /ready fails) and
    re-admitted once it answers again."""
    pid = stack.verifier_proc.p.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_http(f"{stack.url}/ready", status=503, timeout=15)
        r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_http(f"{stack.url}/ready", timeout=15)
    out = stack.client().completions.create(model="tiny", prompt="abc", max_tokens=3)
    assert out.usage.completion_tokens == 3 or out.choices[0].finish_reason == "stop"


def test_verifier_dns_discovers_units(stack: Stack, tmp_path: Path) -> None:
    """`--verifier-dns NAME:PORT` resolves the name to every address (a headless
    Service in Kubernetes; `localhost` here) and routes to the healthy ones."""
    vport = stack.verifier_proc.p.args[stack.verifier_proc.p.args.index("--port") + 1]
    proc, url = start_gateway(
        tmp_path, "--verifier-dns", f"localhost:{vport}", name="gateway-dns", wait_path="/ready"
    )
    try:
        units = httpx.get(f"{url}/ready").json()["units"]
        assert any(u["address"] == f"127.0.0.1:{vport}" and u["healthy"] for u in units)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).usage
    finally:
        proc.stop()


def test_smollm2_chat_equals_its_own_greedy_output(tmp_path: Path) -> None:
    """The embedded SmolLM2-135M-Instruct (real tokenizer and chat template) behind the
    gateway: the chat answer equals the model's own greedy output in transformers."""
    from transformers import AutoTokenizer

    from adaserve.model.embedded import resolve_model

    target = resolve_model("embedded")
    vproc, vaddr = start_verifier(tmp_path, Path("embedded"), None, name="smollm2")
    try:
        with grpc.insecure_channel(vaddr) as ch:
            info = vgrpc.VerifierStub(ch).Info(vpb.InfoRequest())
        gproc, url = start_gateway(tmp_path, "--verifier", vaddr, wait_path="/ready")
    except BaseException:
        vproc.stop()
        raise
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0
        )
        tok = AutoTokenizer.from_pretrained(target)
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(rendered, add_special_tokens=False)
        ref = greedy_reference(target, ids, 24, eos=tuple(info.eos_token_ids))
        assert out.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(ref))
    finally:
        gproc.stop()
        vproc.stop()


def test_demo_against_the_stack(stack: Stack, tmp_path: Path) -> None:
    """`adaserve demo` drives the server with the three classes and writes its table,
    summary and two-panel plot (each class's own SLO, TPOT / SLO over the run)."""
    argv = ["--url", stack.url, "--rps", "3", "--duration", "2", "--max-tokens-scale", "0.2"]
    r = subprocess.run(
        [sys.executable, "-m", "adaserve.cli", "demo", *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    slos = {name: g["tpot_slo_ms"] for name, g in summary["per_class"].items()}
    assert slos and set(slos) <= {"coding", "chat", "summarize"}
    assert all(g["slo_attainment"] is not None for g in summary["per_class"].values())
    assert (tmp_path / "tpot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TPOT p50/p90 ms" in r.stdout


def test_demo_refuses_a_rate_that_is_not_positive() -> None:
    argv = ["--url", "http://127.0.0.1:9", "--rps", "0", "--long-prompts"]
    r = subprocess.run(
        [sys.executable, "-m", "adaserve.cli", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--rps must be positive" in r.stderr, r.stderr
