"""Shared by the differential tests: one all-in-one server (the embedded SmolLM2 pair)
and requests to it with a chosen speculation method."""

from __future__ import annotations

import json
from typing import Any

import httpx

# Every method the all-in-one server offers with the embedded drafter.
METHODS = ("none", "model", "auto")


def post(url: str, endpoint: str, body: dict[str, Any], method: str) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/v1/{endpoint}", json={**body, "speculation": {"method": method}}, timeout=600
    )
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(url: str, body: dict[str, Any], method: str) -> tuple[str, int, int, str]:
    """(content, logprob entries, usage completion_tokens, finish_reason) of a streamed
    chat completion."""
    text, entries, usage, reason = "", 0, -1, ""
    full = {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": {"method": method},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=full, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for c in event.get("choices") or []:
                text += c["delta"].get("content") or ""
                entries += len((c.get("logprobs") or {}).get("content") or [])
                reason = c.get("finish_reason") or reason
    return text, entries, usage, reason
