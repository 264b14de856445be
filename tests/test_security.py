"""Security at the edge, with a real gateway and unit (both logging at DEBUG):

- prompts, completions, API keys and other secrets never reach a log line or a metric
  (unless prompt logging is switched on, which is shown to work, so their absence
  means something);
- API keys guard generation on both fronts, with a unit behind the gateway;
- size limits (body, header, gRPC message) refuse oversized requests cleanly.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from adaserve.rpc.v1 import gateway_pb2 as gpb
from adaserve.rpc.v1 import gateway_pb2_grpc as ggrpc
from tests._serving import Proc, free_port, make_served_model, start_gateway, start_verifier

pytestmark = pytest.mark.slow  # three serving processes

SECRET = f"hunter2-{uuid.uuid4().hex}"  # planted in prompts
API_KEY = f"sk-live-{uuid.uuid4().hex}"
WRONG_KEY = f"sk-stolen-{uuid.uuid4().hex}"
UNIT_CONFIG = """\
engine:
  kv_memory_gb: 0.05
slo:
  baseline_tpot_ms: 20.0
"""
GATEWAY_CONFIG = """\
gateway:
  health_interval_s: 0.5
  max_body_bytes: 65536
  max_header_bytes: 8192
"""


@dataclass
class Edge:
    url: str
    grpc_address: str
    gateway: Proc
    verifier: Proc
    verifier_metrics: str
    root: Path

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    root = tmp_path_factory.mktemp("security")
    target = make_served_model(root / "target")
    mport = free_port()
    vproc, vaddr = start_verifier(root, target, None, config=UNIT_CONFIG, metrics_port=mport)
    cfg = root / "gateway.yaml"
    cfg.write_text(GATEWAY_CONFIG)
    gport = free_port()
    try:
        gproc, url = start_gateway(
            root,
            *("--verifier", vaddr, "--config", str(cfg), "--log-level", "debug"),
            grpc_port=gport,
            env={"ADASERVE_API_KEYS": API_KEY},
            wait_path="/ready",
        )
    except BaseException:
        vproc.stop()
        raise
    try:
        yield Edge(
            url, f"127.0.0.1:{gport}", gproc, vproc, f"http://127.0.0.1:{mport}/metrics", root
        )
    finally:
        gproc.stop()
        vproc.stop()


def _generate_with_secrets(edge: Edge) -> list[str]:
    """Every kind of request a client can make, each carrying the secret; returns the
    completions the server produced."""
    client = edge.client()
    outputs = []
    out = client.completions.create(
        model="tiny", prompt=f"my password is {SECRET}", max_tokens=24, temperature=0
    )
    outputs.append(out.choices[0].text)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"keep {SECRET} safe"}],
        max_tokens=24,
        temperature=0,
    )
    outputs.append(chat.choices[0].message.content or "")
    stream = client.completions.create(
        model="tiny", prompt=f"{SECRET} stream", max_tokens=24, temperature=0, stream=True
    )
    outputs.append("".join(c.choices[0].text for c in stream if c.choices))
    with pytest.raises(openai.AuthenticationError):
        edge.client(WRONG_KEY).completions.create(model="tiny", prompt=SECRET, max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # refused input is not echoed to the logs
        client.completions.create(model="tiny", prompt=SECRET, max_tokens=2, temperature=-1)
    req = gpb.CompleteRequest(options=gpb.RequestOptions(max_tokens=8), text=f"grpc {SECRET}")
    with grpc.insecure_channel(edge.grpc_address) as ch:
        chunks = list(
            ggrpc.GatewayStub(ch).Complete(
                req, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=30
            )
        )
    outputs.append("".join(c.text for c in chunks))
    return outputs


def test_no_secret_prompt_completion_or_key_in_logs_or_metrics(edge: Edge) -> None:
    outputs = _generate_with_secrets(edge)
    texts = {
        "gateway log": edge.gateway.log_path.read_text(errors="replace"),
        "verifier log": edge.verifier.log_path.read_text(errors="replace"),
        "gateway /metrics": httpx.get(f"{edge.url}/metrics").text,
        "verifier /metrics": httpx.get(edge.verifier_metrics).text,
    }
    assert "request finished" in texts["gateway log"]  # the logs are there to search
    needles = {"secret": SECRET, "api key": API_KEY, "wrong key": WRONG_KEY}
    needles |= {f"completion {i}": o for i, o in enumerate(outputs) if len(o) >= 8}
    assert len(needles) >= 5  # completions of 8+ characters to look for
    leaks = [
        (where, what) for where, text in texts.items() for what, n in needles.items() if n in text
    ]
    assert leaks == []


def test_prompt_logging_is_opt_in(edge: Edge) -> None:
    """With `log_prompts` on, the same search finds the prompt: the test above could
    have found it too."""
    proc, url = start_gateway(
        edge.root,
        "--verifier",
        _unit_address(edge),
        name="gateway-log-prompts",
        env={"ADASERVE_LOG_PROMPTS": "true"},
        wait_path="/ready",
    )
    try:
        marker = f"opt-in-{uuid.uuid4().hex}"
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": marker, "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 200
    finally:
        proc.stop()
    log = proc.log_path.read_text(errors="replace")
    assert marker in log and API_KEY not in log


def _unit_address(edge: Edge) -> str:
    args = edge.verifier.p.args
    return f"127.0.0.1:{args[args.index('--port') + 1]}"


# ---- API keys with a unit behind the gateway ----------------------------------------------


def test_api_key_guards_generation_on_both_fronts(edge: Edge) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{edge.url}/v1/completions", json=body).status_code == 401
    ok = httpx.post(
        f"{edge.url}/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{edge.url}/v1/models").status_code == 401
    assert httpx.get(f"{edge.url}/health").status_code == 200  # probes stay open
    with grpc.insecure_channel(edge.grpc_address) as ch:
        stub = ggrpc.GatewayStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListModels(gpb.ListModelsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        models = stub.ListModels(
            gpb.ListModelsRequest(), metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=10
        )
        assert list(models.models) == ["tiny"]


# ---- size limits ------------------------------------------------------------------


def test_oversized_bodies_are_refused_before_parsing(edge: Edge) -> None:
    auth = {"authorization": f"Bearer {API_KEY}"}
    big = {"model": "tiny", "prompt": "x" * 70_000, "max_tokens": 2}
    r = httpx.post(f"{edge.url}/v1/completions", json=big, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'", "max_tokens": 2}'

    r = httpx.post(
        f"{edge.url}/v1/completions",
        content=chunks(),
        headers=auth | {"content-type": "application/json"},
    )
    assert r.status_code == 413 and "larger than 65536 bytes" in r.json()["error"]["message"]
    # Under the limit, the same request is served.
    small = big | {"prompt": "x" * 100}
    assert httpx.post(f"{edge.url}/v1/completions", json=small, headers=auth).status_code == 200


def test_oversized_headers_are_refused(edge: Edge) -> None:
    r = httpx.get(f"{edge.url}/health", headers={"x-padding": "z" * 16_384})
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
    assert httpx.get(f"{edge.url}/health").status_code == 200  # and the server lives on


def test_oversized_grpc_message_is_refused(edge: Edge) -> None:
    req = gpb.CompleteRequest(options=gpb.RequestOptions(max_tokens=2), text="x" * 100_000)
    with (
        grpc.insecure_channel(
            edge.grpc_address, options=[("grpc.max_send_message_length", 1 << 24)]
        ) as ch,
        pytest.raises(grpc.RpcError) as info,
    ):
        list(
            ggrpc.GatewayStub(ch).Complete(
                req, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=10
            )
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
