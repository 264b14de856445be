"""Differential testing of the OpenAI surface: speculation must change nothing.

Each case is one random request drawn from (seed, case number), sent at the same time
twice to one server: once with `speculation.method: none` (plain decoding) and once
with a speculative method (`model`, `auto`, `ngram`). The two responses must agree on
everything the client can see but ids and timing: text, tool calls, token ids (when
`return_tokens_as_token_ids` exposes them), usage, finish reasons, logprobs (values
within LOGPROB_ATOL) and errors (status, type, param). Several cases run at once, so
requests of different shapes share the engine's batches.

A mismatching case is shrunk (fields dropped, max_tokens, n and the prompt cut down
while it still mismatches) and reported as a JSON reproducer: the endpoint, the body
and the speculative method.

Cases are drawn and shrunk in fuzz_cases.py, responses compared in fuzz_compare.py.
`adaserve fuzz` drives it (starting an all-in-one server on a free port unless given
`--url`); tests/differential runs a fixed seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from adaserve.bench.fuzz_cases import Case, draw, reductions, stop_from
from adaserve.bench.fuzz_compare import LOGPROB_ATOL, compare, normalise


@dataclass
class Report:
    cases: int = 0
    requests: int = 0
    features: Counter[str] = field(default_factory=Counter)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    max_logprob_gap: float = 0.0
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "requests": self.requests,
            "elapsed_s": round(self.elapsed_s, 1),
            "max_logprob_gap": self.max_logprob_gap,
            "logprob_atol": LOGPROB_ATOL,
            "mismatches": len(self.mismatches),
            "features": dict(sorted(self.features.items())),
        }


# ---- sending ----------------------------------------------------------------------------


async def send(
    client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], method: str
) -> dict[str, Any]:
    """The response as the comparison sees it (`normalise`)."""
    full = {**body, "speculation": {"method": method}}
    if not body.get("stream"):
        r = await client.post(f"/v1/{endpoint}", json=full)
        return normalise(r.status_code, r.json(), None)
    events: list[dict[str, Any]] = []
    async with client.stream("POST", f"/v1/{endpoint}", json=full) as r:
        if r.status_code != 200:
            return normalise(r.status_code, json.loads(await r.aread()), None)
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return normalise(200, None, events)


# ---- running ----------------------------------------------------------------------------


class Fuzzer:
    def __init__(self, url: str, seed: int, concurrency: int = 3, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.seed = seed
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.report = Report()

    async def run(
        self, seconds: float, max_cases: int | None = None, first_case: int = 0
    ) -> Report:
        """Cases first_case, first_case + 1, ... until `seconds` or `max_cases` pass."""
        start = time.monotonic()
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s) as client:
            methods = await self._methods(client)
            next_index = first_case

            async def worker() -> None:
                nonlocal next_index
                while time.monotonic() - start < seconds and (
                    max_cases is None or next_index < first_case + max_cases
                ):
                    index = next_index
                    next_index += 1
                    await self._case(client, draw(self.seed, index, methods))

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        self.report.elapsed_s = time.monotonic() - start
        return self.report

    async def _methods(self, client: httpx.AsyncClient) -> list[str]:
        r = await client.get("/v1/models")
        r.raise_for_status()
        listed = r.json()["data"][0].get("slo", {}).get("speculation_methods") or []
        methods = [m for m in listed if m != "none"]
        if not methods:
            raise RuntimeError("the server offers no speculative method: nothing to compare")
        return sorted(methods)

    async def _case(self, client: httpx.AsyncClient, case: Case) -> None:
        if case.probe_stop:
            await self._probe(client, case)
        diffs = await self._differs(client, case)
        self.report.cases += 1
        self.report.features.update(case.features)
        if diffs:
            small = await self._shrink(client, case)
            self.report.mismatches.append(
                {
                    "case": case.index,
                    "seed": self.seed,
                    "differences": diffs[:8],
                    "reproducer": small.reproducer(),
                    "drawn": case.reproducer(),
                }
            )

    async def _probe(self, client: httpx.AsyncClient, case: Case) -> None:
        """Stop strings cut from the plain output of the same request (so they hit)."""
        body = {k: v for k, v in case.body.items() if k not in ("stream", "stream_options")}
        body["n"] = 1
        self.report.requests += 1
        out = await send(client, case.endpoint, body, "none")
        if "error" in out or not out["choices"]:
            return
        stops = stop_from(
            out["choices"][0]["text"], random.Random(f"{self.seed}:{case.index}:stop")
        )
        if stops:
            case.body["stop"] = stops

    async def _differs(self, client: httpx.AsyncClient, case: Case) -> list[str]:
        self.report.requests += 2
        plain, spec = await asyncio.gather(
            send(client, case.endpoint, case.body, "none"),
            send(client, case.endpoint, case.body, case.method),
        )
        diffs, gap = compare(plain, spec)
        self.report.max_logprob_gap = max(self.report.max_logprob_gap, gap)
        if not diffs and "error" not in plain:
            self._count_outcome(case, plain)
        return diffs

    def _count_outcome(self, case: Case, out: dict[str, Any]) -> None:
        reasons = {c["finish_reason"] for c in out["choices"]}
        if "stop" in case.body and "stop" in reasons:
            case.features.append("stop hit")
        if any(c["tool_calls"] for c in out["choices"]):
            case.features.append("tool calls returned")
        if "length" in reasons:
            case.features.append("finish length")

    async def _shrink(self, client: httpx.AsyncClient, case: Case, budget: int = 30) -> Case:
        """Smaller requests that still mismatch, greedily: drop a field, halve
        max_tokens, n and the prompt; keep any change that still mismatches."""
        current = case
        tries = 0
        changed = True
        while changed and tries < budget:
            changed = False
            for candidate in reductions(current):
                tries += 1
                if await self._differs(client, candidate):
                    current, changed = candidate, True
                    break
                if tries >= budget:
                    break
        return current


# ---- a server to fuzz -------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def all_in_one(
    log_dir: Path,
    args: list[str] | None = None,
    timeout_s: float = 600.0,
    kv_blocks: int | None = None,
    metrics_port: int = 0,
) -> Iterator[str]:
    """`adaserve up --all-in-one` (the embedded pair unless `args` says otherwise) on a
    free port; yields its base URL once /ready answers, stops it after."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = (log_dir / "up.log").open("w")
    argv = [
        sys.executable,
        "-m",
        "adaserve",
        "up",
        "--all-in-one",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),  # 0: no engine metrics
        "--log-dir",
        str(log_dir),
        *(args or []),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    if kv_blocks is not None:  # a small KV cache: concurrent cases preempt each other
        env["ADASERVE_ENGINE__KV_BLOCKS"] = str(kv_blocks)
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = (log_dir / "up.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"adaserve up exited with {proc.returncode}:\n{tail}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{url}/ready", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"adaserve up not ready after {timeout_s:.0f} s")
            time.sleep(1.0)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def preemptions(metrics_url: str) -> float | None:
    """adaserve_num_preemptions_total from an engine's metrics endpoint (None: unreadable)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("adaserve_num_preemptions_total "):
            return float(line.split()[1])
    return None
