"""The gateway process with no healthy serving unit: valid requests get a clean 503,
invalid ones a 400 with an OpenAI-style body (never a 500), probes and metrics work,
and the official `openai` client sees the documented errors. API keys too."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from adaserve.rpc.v1 import gateway_pb2 as gpb
from adaserve.rpc.v1 import gateway_pb2_grpc as ggrpc
from tests._serving import REPO, Proc, free_port, start_gateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.fixture(scope="module")
def gateway_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str]]:
    dead = free_port()  # nothing listens there
    proc, url = start_gateway(tmp_path_factory.mktemp("gw"), "--verifier", f"127.0.0.1:{dead}")
    try:
        yield proc, url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def gateway(gateway_proc: tuple[Proc, str]) -> str:
    return gateway_proc[1]


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_probes(gateway: str) -> None:
    assert httpx.get(f"{gateway}/health").json() == {"status": "ok"}
    r = httpx.get(f"{gateway}/ready")
    err = _assert_error(r, 503)
    assert err["code"] == "no_healthy_unit"
    assert r.json()["units"][0]["healthy"] is False
    assert httpx.get(f"{gateway}/v1/models").json() == {"object": "list", "data": []}


@pytest.mark.parametrize("path,body", [("completions", COMPLETION), ("chat/completions", CHAT)])
def test_valid_request_without_units_is_503(gateway: str, path: str, body: dict) -> None:
    r = httpx.post(f"{gateway}/v1/{path}", json=body)
    err = _assert_error(r, 503)
    assert err["type"] == "service_unavailable_error"
    assert "Retry-After" in r.headers


BAD = [
    ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat/completions", {**CHAT, "stream": False, "stream_options": {}}, "stream_options"),
    ("completions", {"prompt": "x", "max_tokens": 0}, None),  # 0 needs echo
    ("completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": "1"}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {**CHAT, "prompt_logprobs": 99}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": "lots"}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "n": 17}, "n"),  # over gateway.max_n (16)
    ("completions", {"prompt": "x", "n": 2, "best_of": 1}, None),
    ("completions", {"prompt": "x", "best_of": 17}, "best_of"),
    ("completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ("completions", {"prompt": ["x"] * 33}, "prompt"),  # over gateway.max_prompts (32)
    ("completions", {"prompt": [[]]}, "prompt"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1.0}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101.0}}, "logit_bias"),
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("completions", {"prompt": "x", "bad_words": [""]}, "bad_words"),
    ("completions", {"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ("completions", {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ("completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
    ("completions", {"prompt": "x", "guided_regex": "a", "guided_json": {}}, "guided_regex"),
    ("chat/completions", {**CHAT, "top_logprobs": 3}, None),  # needs logprobs: true
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, None),
    # TGI's grammar in response_format: a value for json / regex only, of the right kind.
    ("chat/completions", {**CHAT, "response_format": {"type": "json"}}, "response_format"),
    ("chat/completions", {**CHAT, "response_format": {"type": "regex"}}, "response_format"),
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "regex", "value": {"type": "object"}}},
        "response_format",
    ),
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "text", "value": "[a-z]+"}},
        "response_format",
    ),
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "json", "value": "{not json"}},
        "response_format.value",
    ),
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_object", "json_schema": {"schema": {}}}},
        "response_format",
    ),
    ("chat/completions", {**CHAT, "tool_choice": "required"}, None),  # no tools
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
        "guided_regex",
    ),
    ("completions", {"prompt": "x", "tpot_slo_ms": -5}, "tpot_slo_ms"),
    ("completions", {"prompt": "x", "tpot_slo_ms": 0}, "tpot_slo_ms"),
    ("completions", {"prompt": "x", "tpot_slo_ms": 1e12}, "tpot_slo_ms"),
    ("completions", {"prompt": "x", "ttft_slo_ms": -5}, "ttft_slo_ms"),
    ("completions", {"prompt": "x", "ttft_slo_ms": 0}, "ttft_slo_ms"),
    ("completions", {"prompt": "x", "ttft_slo_ms": 1e12}, "ttft_slo_ms"),
    ("completions", {"prompt": "x", "ttft_slo_ms": "soon"}, "ttft_slo_ms"),
    ("chat/completions", {**CHAT, "ttft_slo_ms": True}, "ttft_slo_ms"),
    ("completions", {"prompt": "x", "slo_class": "platinum"}, "slo_class"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("completions", {"prompt": "x", "stop": [str(i) for i in range(9)]}, "stop"),
    ("completions", {"prompt": "x", "request_id": "bad id\nforged"}, "request_id"),
    ("completions", {"prompt": "x", "timeout": -1}, "timeout"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": "x" * 200_001}, "prompt"),
    ("completions", {"max_tokens": 5}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, None),
    ("completions", {"prompt": "x", "speculation": {"method": "fast"}}, "speculation.method"),
    ("chat/completions", {**CHAT, "speculation": {"method": 3}}, "speculation.method"),
    ("chat/completions", {**CHAT, "speculation": {}}, "speculation.method"),
    ("chat/completions", {**CHAT, "speculation": "ngram"}, "speculation"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_invalid_request_is_400(gateway: str, path: str, body: dict, param: str | None) -> None:
    r = httpx.post(f"{gateway}/v1/{path}", json={"model": "m", **body})
    err = _assert_error(r, 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


UNSUPPORTED = [
    ("completions", {"prompt": "x", "suffix": "end"}, "suffix"),
    ("completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt": "x", "length_penalty": 0.5}, "length_penalty"),
    ("completions", {"prompt": "x", "skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {"prompt": "x", "include_stop_str_in_output": True}, None),
    ("completions", {"prompt": "x", "guided_decoding_backend": "xgrammar"}, None),
    ("completions", {"prompt": "x", "logits_processors": ["x"]}, "logits_processors"),
    ("completions", {"prompt": "x", "store": True}, "store"),
    ("completions", {"prompt": "x", "service_tier": "flex"}, "service_tier"),
    (
        "completions",
        {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    (
        "completions",
        {"prompt": "x", "structured_outputs": {"structural_tag": {"x": 1}}},
        "structured_outputs.structural_tag",
    ),
    ("chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {**CHAT, "audio": {"voice": "alloy"}}, "audio"),
    ("chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {**CHAT, "prediction": {"type": "content"}}, "prediction"),
    ("chat/completions", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
    ("chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
    ("chat/completions", {**CHAT, "echo": True}, "echo"),
    ("chat/completions", {**CHAT, "chat_template": "{{ x }}"}, "chat_template"),
]


@pytest.mark.parametrize("path,body,param", UNSUPPORTED)
def test_unsupported_feature_is_named(gateway: str, path: str, body: dict, param: str) -> None:
    """A known feature adaserve does not offer is a 400 naming it (code unsupported),
    never silently ignored; the check's own words reach the client."""
    r = httpx.post(f"{gateway}/v1/{path}", json={"model": "m", **body})
    err = _assert_error(r, 400)
    assert err["code"] == "unsupported", err
    name = param or next(k for k in body if k not in ("prompt", "messages", "model"))
    assert err["param"] == name and name in err["message"], err
    assert "not supported" in err["message"] or "only" in err["message"], err
    assert not err["message"].startswith("Value error"), err


# Accepted: honoured, or a value that changes nothing (reaches routing: no unit, 503).
ACCEPTED = [
    ("completions", {"prompt": ["a", "b"], "n": 2, "echo": True}),
    ("completions", {"prompt": ["a", "b"], "echo": True, "logprobs": 1, "max_tokens": 1}),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}),
    ("completions", {"prompt": "x", "echo": True, "max_tokens": 0}),
    ("completions", {"prompt": "x", "prompt_logprobs": 0}),
    ("chat/completions", {**CHAT, "prompt_logprobs": 20}),
    ("completions", {"prompt": [[1, 2], [3]], "best_of": 3, "logprobs": 2}),
    ("completions", {"prompt": "x", "skip_special_tokens": True, "length_penalty": 1.0}),
    ("completions", {"prompt": "x", "guided_decoding_backend": "guidance"}),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "[a-z]+"}}),
    ("chat/completions", {**CHAT, "response_format": {"type": "json", "value": {}}}),
    ("chat/completions", {**CHAT, "response_format": {"type": "regex", "value": "[a-z]+"}}),
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_object", "value": '{"type": "object"}'}},
    ),
    ("completions", {"prompt": "x", "user": "u", "service_tier": "auto", "store": False}),
    (
        "chat/completions",
        {
            **CHAT,
            "logprobs": True,
            "top_logprobs": 5,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"5": -100, "7": 3.5},
            "min_p": 0.1,
            "min_tokens": 3,
            "bad_words": ["cat"],
            "allowed_token_ids": [1, 2, 3],
            "modalities": ["text"],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
            },
        },
    ),
]


@pytest.mark.parametrize("path,body", ACCEPTED)
def test_supported_fields_pass_validation(gateway: str, path: str, body: dict) -> None:
    _assert_error(httpx.post(f"{gateway}/v1/{path}", json={"model": "m", **body}), 503)


@pytest.mark.parametrize(
    "content,ctype",
    [
        (b"{not json", "application/json"),
        (b"", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'"a string"', "application/json"),
        (json.dumps(COMPLETION).encode(), "text/plain"),
        (b'{"prompt": "x", "tpot_slo_ms": NaN}', "application/json"),
        (b'{"prompt": "x", "temperature": Infinity}', "application/json"),
        (b"\xff\xfe\x00garbage", "application/json"),
    ],
)
def test_malformed_body_is_400(gateway: str, content: bytes, ctype: str) -> None:
    r = httpx.post(f"{gateway}/v1/completions", content=content, headers={"content-type": ctype})
    _assert_error(r, 400)


@pytest.mark.parametrize("field", ["tpot_slo_ms", "ttft_slo_ms"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_slo_is_400_naming_the_field(gateway: str, field: str, value: str) -> None:
    body = f'{{"model": "m", "prompt": "x", "{field}": {value}}}'.encode()
    r = httpx.post(
        f"{gateway}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    _assert_error(r, 400, param=field)


@pytest.mark.parametrize("header", ["x-slo-tpot-ms", "x-slo-ttft-ms"])
@pytest.mark.parametrize("value", ["fast", "-1", "0", "nan", "inf", ""])
def test_bad_slo_header_is_400(gateway: str, header: str, value: str) -> None:
    r = httpx.post(f"{gateway}/v1/chat/completions", json=CHAT, headers={header: value})
    _assert_error(r, 400, param=header)


def test_unknown_fields_are_ignored_with_a_warning(gateway_proc: tuple[Proc, str]) -> None:
    proc, gateway = gateway_proc
    # Only routing fails (no unit), so validation accepted the body; the gateway's log
    # names every field it ignored (vLLM's warning), nested ones by their path.
    body = {**CHAT, "some_future_field": {"x": 1}}
    body["messages"] = [{"role": "user", "content": "hi", "colour_hint": "red"}]
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body)
    _assert_error(r, 503)
    log = proc.log_path.read_text(errors="replace")
    line = next(x for x in log.splitlines() if "request fields ignored" in x)
    assert "some_future_field" in line and "messages.0.colour_hint" in line
    # A request with only known fields logs nothing of the kind.
    _assert_error(httpx.post(f"{gateway}/v1/chat/completions", json=CHAT), 503)
    after = proc.log_path.read_text(errors="replace")
    assert after.count("request fields ignored") == log.count("request fields ignored")


def test_non_text_content_part_is_named(gateway: str) -> None:
    """An image part in a chat message: a 400 naming the part's type, not the union's
    first branch ("content.str: Input should be a valid string")."""
    part = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    body = {**CHAT, "messages": [{"role": "user", "content": [part]}]}
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body)
    err = _assert_error(r, 400, param="messages.0.content")
    assert "'image_url'" in err["message"] and "text only" in err["message"]
    # Text parts still pass validation (routing fails: no unit).
    text = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    _assert_error(httpx.post(f"{gateway}/v1/chat/completions", json=text), 503)


def test_unknown_route_and_method(gateway: str) -> None:
    _assert_error(httpx.get(f"{gateway}/v1/nothing"), 404)
    _assert_error(httpx.get(f"{gateway}/v1/completions"), 405)


def test_openai_client_sees_documented_errors(gateway: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:  # 503
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="m", prompt="hi", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], n=17
        )


def test_metrics_count_rejections(gateway: str) -> None:
    httpx.post(f"{gateway}/v1/completions", json={"prompt": "x", "max_tokens": -1})
    text = httpx.get(f"{gateway}/metrics").text
    assert (
        'adaserve_gateway_requests_total{endpoint="completion",slo_class="",status="400"}' in text
    )
    assert "adaserve_gateway_healthy_units 0.0" in text


@pytest.fixture(scope="module")
def keyed_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    gport = free_port()
    logs = tmp_path_factory.mktemp("gw-keys")
    keys = logs / "keys.txt"
    keys.write_text("# team keys\nsk-file-key\n\n")
    cfg = logs / "cfg.yaml"
    cfg.write_text(f"gateway:\n  api_keys_file: {keys}\n  metrics_require_auth: true\n")
    proc, url = start_gateway(
        logs,
        "--config",
        str(cfg),
        grpc_port=gport,
        env={"ADASERVE_API_KEYS": "sk-env-1,sk-env-2"},
    )
    try:
        yield url, f"127.0.0.1:{gport}"
    finally:
        proc.stop()


def test_api_keys(keyed_gateway: tuple[str, str]) -> None:
    base, _ = keyed_gateway
    url = f"{base}/v1/chat/completions"
    err = _assert_error(httpx.post(url, json=CHAT), 401)
    assert err["code"] == "invalid_api_key"
    _assert_error(httpx.post(url, json=CHAT, headers={"authorization": "Bearer sk-nope"}), 401)
    _assert_error(httpx.post(url, json=CHAT, headers={"authorization": "Basic sk-env-1"}), 401)
    for key in ("sk-file-key", "sk-env-1", "sk-env-2"):
        # Authenticated: reaches routing, which has no unit.
        r = httpx.post(url, json=CHAT, headers={"authorization": f"Bearer {key}"})
        _assert_error(r, 503)
    # Probes stay open; metrics were configured to require a key.
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/ready").status_code == 503
    _assert_error(httpx.get(f"{base}/metrics"), 401)
    ok = httpx.get(f"{base}/metrics", headers={"authorization": "Bearer sk-env-2"})
    assert ok.status_code == 200
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_api_keys_on_grpc(keyed_gateway: tuple[str, str]) -> None:
    _, address = keyed_gateway
    req = gpb.CompleteRequest(options=gpb.RequestOptions(max_tokens=2), text="hi")
    with grpc.insecure_channel(address) as ch:
        stub = ggrpc.GatewayStub(ch)
        for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Complete(req, metadata=metadata, timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:  # let in; no unit behind it
            list(
                stub.Complete(req, metadata=(("authorization", "Bearer sk-file-key"),), timeout=10)
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "args,message",
    [
        (["--verifier", "no-port"], "--verifier must be HOST:PORT"),
        (["--verifier-dns", "svc"], "--verifier-dns must be HOST:PORT"),
        (["--config", "/no/such.yaml"], "config file not found"),
    ],
)
def test_bad_command_line_fails_cleanly(args: list[str], message: str) -> None:
    """The flag's own error wins even when the gRPC port is taken (a busy default port
    on the user's machine must not hide which flag is wrong)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = str(held.getsockname()[1])
        r = subprocess.run(
            [
                *(sys.executable, "-m", "adaserve.cli", "gateway", "--host", "127.0.0.1"),
                *("--port", "0", "--grpc-port", taken, *args),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr


def test_unknown_fields_are_refused_when_configured(tmp_path) -> None:
    """gateway.unknown_fields: reject names the first unknown field, at any depth;
    known fields, honoured or accepted, still pass (to routing: no unit here)."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("gateway:\n  unknown_fields: reject\n")
    dead = free_port()
    proc, url = start_gateway(tmp_path, "--verifier", f"127.0.0.1:{dead}", "--config", str(cfg))
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "some_future_field": 1})
        err = _assert_error(r, 400, param="some_future_field")
        assert err["code"] == "unknown_field"
        nested = {**CHAT, "messages": [{"role": "user", "content": "x", "colour": "red"}]}
        _assert_error(
            httpx.post(f"{url}/v1/chat/completions", json=nested), 400, "messages.0.colour"
        )
        known = {**COMPLETION, "min_p": 0.1, "user": "u", "request_id": "r1"}
        _assert_error(httpx.post(f"{url}/v1/completions", json=known), 503)
        r = httpx.post(f"{url}/tokenize", json={"prompt": "x", "extra": 1})
        _assert_error(r, 400, param="extra")
    finally:
        proc.stop()
