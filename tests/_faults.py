"""A whole adaserve deployment as separate processes on loopback, for fault tests.

Each service listens on a port fixed at creation, so it can be killed and restarted in
place (a crashed pod coming back under the same Service). `StreamRecorder` follows one
verifier stream on a thread and keeps every chunk with its arrival time, so tests can
check what a client saw: tokens, order, gaps and how the stream ended.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import httpx

from adaserve.rpc.v1 import drafter_pb2, drafter_pb2_grpc
from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from tests._serving import Proc, free_port, wait_grpc_serving, wait_http

T = TypeVar("T")


@dataclass
class Service:
    """One `adaserve` subcommand on a fixed loopback port; `argv` follows --host/--port."""

    name: str
    argv: list[str]
    workdir: Path
    http: bool = False  # the gateway: health over HTTP, not gRPC
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    proc: Proc | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def launch(self, env: dict[str, str] | None = None) -> None:
        """Starts the process without waiting (several can then load in parallel)."""
        self.starts += 1
        args = [self.argv[0], "--host", "127.0.0.1", "--port", str(self.port), *self.argv[1:]]
        log = self.workdir / f"{self.name}-{self.starts}.log"
        self.proc = Proc(args, log, {**self.env, **(env or {})})

    def wait_ready(self, timeout: float = 180.0) -> None:
        assert self.proc is not None
        if self.http:
            wait_http(f"{self.url}/ready", self.proc, timeout=timeout)
        else:
            wait_grpc_serving(self.address, self.proc, timeout=timeout)

    def start(self, env: dict[str, str] | None = None) -> None:
        self.launch(env)
        self.wait_ready()

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye, as a crashed process or a lost node."""
        if self.proc is not None:
            self.proc.stop(signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def pause(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.p.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.p.pid, signal.SIGCONT)

    def logs(self) -> str:
        """Every log this service wrote, across restarts."""
        return "".join(
            p.read_text(errors="replace") for p in sorted(self.workdir.glob(f"{self.name}-*.log"))
        )


def greedy_reference_ignore_eos(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation of exactly `n` tokens, eos included
    (Hugging Face `generate`, no adaserve code): what an `ignore_eos` request streams."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend with the servers
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():  # an explicit mask: otherwise pad-id tokens would be masked
            out = _generator(str(model_dir)).generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
    finally:
        torch.set_num_threads(threads)
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == n
    return tokens


@functools.cache
def _generator(model_dir: str):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # No eos: nothing stops early, and no logit is masked (min_new_tokens would).
    model.generation_config.eos_token_id = None
    return model


def greedy_request(
    rid: str, prompt: list[int], max_tokens: int, **kw: object
) -> vpb.GenerateRequest:
    req = vpb.GenerateRequest(
        request_id=rid,
        sampling=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        tpot_slo_ms=50.0,
        **kw,
    )
    req.token_ids.ids.extend(prompt)
    return req


class StreamRecorder:
    """Follows one Generate stream on a thread: chunks, arrival times, and its end."""

    def __init__(self, stub: vgrpc.VerifierStub, req: vpb.GenerateRequest, timeout: float = 120):
        self.request_id = req.request_id
        self.tokens: list[int] = []
        self.times: list[float] = []  # monotonic arrival of each chunk with tokens
        self.finish: int | None = None
        self.error: grpc.RpcError | None = None
        self._call = stub.Generate(req, timeout=timeout)
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for chunk in self._call:
                if chunk.token_ids:
                    self.tokens.extend(chunk.token_ids)
                    self.times.append(time.monotonic())
                if chunk.finish_reason != vpb.FINISH_REASON_UNSPECIFIED:
                    self.finish = chunk.finish_reason
        except grpc.RpcError as err:
            self.error = err

    def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"{self.request_id}: {len(self.tokens)} tokens, wanted {n}")
            time.sleep(0.01)

    def join(self, timeout: float = 120.0) -> StreamRecorder:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.request_id} still streaming"
        return self

    def max_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


def metric(url: str, name: str, labels: str = "") -> float:
    """A counter or gauge from a Prometheus text endpoint (0 when absent)."""
    text = httpx.get(url, timeout=5).text
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    m = re.search("^" + pattern + "$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def verifier_stats(address: str) -> vpb.VerifierStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return vgrpc.VerifierStub(ch).Stats(vpb.VerifierStatsRequest(), timeout=5)


def drafter_stats(address: str) -> drafter_pb2.StatsResponse:
    with grpc.insecure_channel(address) as ch:
        return drafter_pb2_grpc.DrafterStub(ch).Stats(drafter_pb2.StatsRequest(), timeout=5)


def wait_until(
    what: str, cond: Callable[[], T], timeout: float = 30.0, interval: float = 0.05
) -> T:
    """Polls `cond()` until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError, httpx.HTTPError):
            last = cond()
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


# Long enough that a stream is still flowing when a fault hits it (the tiny model's
# context is 512).
LONG = 480


class SSEClient:
    """One streaming /v1/completions request on a thread, as a client sees it."""

    def __init__(
        self, url: str, prompt: list[int], max_tokens: int = LONG, model: str = "tiny"
    ) -> None:
        self.body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        self.url = url
        self.frames: list[str] = []
        self.status: int | None = None
        self.transport_error: Exception | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json=self.body, timeout=120
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.frames.append(line[len("data: ") :])
        except httpx.TransportError as exc:  # the connection died under us
            self.transport_error = exc

    def join(self) -> SSEClient:
        self._thread.join(120)
        assert not self._thread.is_alive()
        return self

    @property
    def completed(self) -> bool:
        return bool(self.frames) and self.frames[-1] == "[DONE]"

    def text(self) -> str:
        parts = []
        for frame in self.frames:
            if frame != "[DONE]" and "choices" in (obj := json.loads(frame)):
                parts.extend(c["text"] for c in obj["choices"])
        return "".join(parts)

    def error(self) -> dict | None:
        if self.frames and self.frames[-1] != "[DONE]":
            return json.loads(self.frames[-1]).get("error")
        return None
