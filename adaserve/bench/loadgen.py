"""Replays a workload trace against an OpenAI-compatible server, like vLLM's
benchmark_serving: every request is sent at its arrival time (open loop), streamed,
and timed per chunk; the records feed the same summary as a simulated run.

Requests use `/v1/completions` with a prompt of token ids (the workload's prompt
length exactly, whatever the tokenizer), `max_tokens` = the sampled output length with
`ignore_eos` (the output length is the workload's, not the model's), greedy decoding,
and the request's SLO as `tpot_slo_ms`.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from adaserve.bench import PROMPT_VOCAB
from adaserve.sim.summary import RequestRecord
from adaserve.sim.workload import SimRequest


@dataclass(frozen=True)
class BenchTarget:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None
    api_key: str | None = None
    prompt_vocab: tuple[int, int] = PROMPT_VOCAB
    timeout_s: float = 600.0
    priority_by_slo: bool = False  # send vLLM `priority` = SLO in us (tight first)


def prompt_ids(req: SimRequest, vocab: tuple[int, int]) -> list[int]:
    """Deterministic per request id: reruns send identical prompts."""
    rng = np.random.default_rng(zlib.crc32(req.id.encode()))
    return rng.integers(vocab[0], vocab[1], size=req.prompt_tokens).tolist()


def request_body(req: SimRequest, target: BenchTarget) -> dict:
    body = {
        "prompt": prompt_ids(req, target.prompt_vocab),
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # The SLO travels as a number: a server's named classes need not match the
        # workload's (and an unknown `slo_class` is a 400).
        "tpot_slo_ms": req.tpot_slo_ms,
        "request_id": req.id,
    }
    if req.ttft_slo_ms is not None:
        body["ttft_slo_ms"] = req.ttft_slo_ms
    if target.model:
        body["model"] = target.model
    if target.priority_by_slo:
        body["priority"] = round(req.tpot_slo_ms * 1000)
    return body


async def _one(
    client: httpx.AsyncClient,
    req: SimRequest,
    target: BenchTarget,
    t0: float,
    clock: Callable[[], float],
) -> RequestRecord:
    rec = RequestRecord(
        id=req.id,
        slo_class=req.slo_class,
        tpot_slo_ms=req.tpot_slo_ms,
        arrival_s=req.arrival_s,
        prompt_tokens=req.prompt_tokens,
        max_tokens=req.output_tokens,
        ttft_slo_ms=req.ttft_slo_ms,
    )
    delay = t0 + req.arrival_s - clock()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.arrival_s = clock() - t0  # when it was actually sent
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream(
            "POST", f"{target.url.rstrip('/')}/v1/completions", json=request_body(req, target)
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                rec.finish_reason = "rejected" if resp.status_code == 429 else "error"
                rec.error = f"HTTP {resp.status_code}: {text}"
                rec.finish_s = clock() - t0
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = clock() - t0
                obj = json.loads(data)
                if obj.get("usage"):
                    usage_tokens = int(obj["usage"].get("completion_tokens", 0))
                if "error" in obj:
                    rec.finish_reason, rec.error = "error", str(obj["error"])[:300]
                for choice in obj.get("choices") or []:
                    if choice.get("text"):
                        chunks += 1
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                        rec.last_token_s = now
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.finish_reason, rec.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    rec.finish_s = clock() - t0
    # Tokens: the usage chunk is exact; without it every text chunk counts one token
    # (an undercount under speculation, which sends several tokens per chunk).
    rec.num_tokens = usage_tokens if usage_tokens is not None else chunks
    if rec.finish_reason is None:
        rec.finish_reason, rec.error = "error", rec.error or "stream ended without a finish"
    return rec


async def replay(
    requests: Sequence[SimRequest],
    target: BenchTarget,
    progress: Callable[[RequestRecord], object] | None = None,  # return value ignored
) -> list[RequestRecord]:
    """Send every request at its arrival offset; returns records in trace order."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    clock = time.monotonic
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        t0 = clock()

        async def run(req: SimRequest) -> RequestRecord:
            rec = await _one(client, req, target, t0, clock)
            if progress is not None:
                progress(rec)
            return rec

        return list(await asyncio.gather(*(run(r) for r in requests)))
