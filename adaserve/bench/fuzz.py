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

`adaserve fuzz` drives it (starting an all-in-one server on a free port unless given
`--url`); tests/differential runs a fixed seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
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

# Logprobs of the same token at the same position, from a verify forward over a tree and
# from a one-token forward: the target's float32 arithmetic in a different order (batch
# shape, blocking of the matmuls), nothing else. A float32 dot product over SmolLM2's
# hidden size d = 576 is off by about sqrt(d) * 2^-24 = 1.4e-6 relative; through 30
# layers, as a random walk, sqrt(30) times that = 8e-6; on logits up to ~30 that is
# 2.3e-4, and a log-softmax moves by at most twice its largest logit's error: 5e-4.
# 1e-3 is twice that estimate (measured: at most 1.9e-5 over 147 cases in 10 minutes),
# and far below what a real defect moves (a wrong position or token: tenths or more).
LOGPROB_ATOL = 1e-3

# Prompts: short (the CPU pays for every token), some repetitive so n-gram drafts hit.
PROMPTS = [
    "Tell me about colours.",
    "Write a Python function that reverses a string.",
    "List the days of the week.",
    "Explain photosynthesis in one sentence.",
    "Count from one to ten: one, two, three,",
    "The capital of France is",
    "Summarize: The cat sat on the mat. The cat sat on the mat again. The cat slept.",
    "def fibonacci(n):",
]
SYSTEM = "You are a helpful assistant. Be brief."
NEVER = "\u2603\u2603qz"  # a stop string the model does not write
VOCAB = 49152  # the embedded target's (logit_bias ids below it)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "n"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,3}\."
CHOICES = ["red", "green", "blue", "yellow"]


@dataclass
class Case:
    """One drawn request: where it goes, its body (without `speculation`), the method
    the speculative side asks for, and the features it exercises."""

    index: int
    endpoint: str  # "chat/completions" or "completions"
    body: dict[str, Any]
    method: str
    features: list[str] = field(default_factory=list)
    probe_stop: bool = False  # draw stop strings from the plain output first

    def reproducer(self) -> dict[str, Any]:
        return {
            "endpoint": f"/v1/{self.endpoint}",
            "speculation_method": self.method,
            "body": self.body,
        }


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


# ---- drawing ----------------------------------------------------------------------------


def draw(seed: int, index: int, methods: list[str]) -> Case:
    """Case `index` of `seed`: the same request every time (its own generator, so a case
    is reproduced without drawing the ones before it)."""
    rng = random.Random(f"{seed}:{index}")
    chat = rng.random() < 0.6
    endpoint = "chat/completions" if chat else "completions"
    feats: list[str] = [endpoint]
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {}
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    body["max_tokens"] = rng.choice([1, 2, 3]) if rng.random() < 0.2 else rng.randint(4, 24)
    if body["max_tokens"] <= 3:
        feats.append("tiny max_tokens")
    if rng.random() < 0.5:
        body["temperature"] = 0.0
        feats.append("greedy")
    else:
        body["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        body["seed"] = rng.randint(0, 2**31)
        if rng.random() < 0.4:
            body["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([5, 40])
        if rng.random() < 0.2:
            body["min_p"] = 0.05
        feats.append("seeded sampling")
    if rng.random() < 0.25:
        body["n"] = rng.randint(2, 3)
        feats.append("n>1")
    if rng.random() < 0.35:
        body["stream"] = True
        feats.append("stream")
        if rng.random() < 0.7:
            body["stream_options"] = {"include_usage": True}
    case = Case(index, endpoint, body, rng.choice(methods), feats)
    feats.append(f"method {case.method}")
    _draw_logprobs(rng, case, chat)
    _draw_processors(rng, case)
    structured = _draw_structure(rng, case, chat)
    _draw_stop(rng, case)
    if not structured and rng.random() < 0.1:
        body["ignore_eos"] = True
        feats.append("ignore_eos")
    _draw_slo(rng, case)
    return case


def _draw_logprobs(rng: random.Random, case: Case, chat: bool) -> None:
    body, feats = case.body, case.features
    if rng.random() < 0.4:
        k = rng.randint(0, 5)
        if chat:
            body["logprobs"] = True
            if rng.random() < 0.7:
                body["top_logprobs"] = k
        else:
            body["logprobs"] = k
        feats.append("logprobs")
        if k:
            feats.append("top_logprobs")
        if rng.random() < 0.4:
            body["return_tokens_as_token_ids"] = True
            feats.append("token ids")
    if not chat and rng.random() < 0.15 and not body.get("stream"):
        body["echo"] = True
        feats.append("echo")


def _draw_processors(rng: random.Random, case: Case) -> None:
    body, feats = case.body, case.features
    if rng.random() < 0.2:
        body["presence_penalty"] = rng.choice([-0.5, 0.5, 1.5])
        body["frequency_penalty"] = rng.choice([0.0, 0.5, 1.0])
        feats.append("penalties")
    if rng.random() < 0.1:
        body["repetition_penalty"] = rng.choice([1.1, 1.3])
        feats.append("repetition_penalty")
    if rng.random() < 0.2:
        body["logit_bias"] = {
            str(rng.randrange(VOCAB)): rng.choice([-100.0, -5.0, 5.0])
            for _ in range(rng.randint(1, 4))
        }
        feats.append("logit_bias")
    if rng.random() < 0.15:
        body["min_tokens"] = rng.randint(1, body["max_tokens"])
        feats.append("min_tokens")


def _draw_structure(rng: random.Random, case: Case, chat: bool) -> bool:
    """A grammar or tools, at most one of them; True when drawn."""
    body, feats = case.body, case.features
    roll = rng.random()
    if roll < 0.06:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": SCHEMA},
        }
        feats.append("json_schema")
    elif roll < 0.09:
        body["response_format"] = {"type": "json_object"}
        feats.append("json_object")
    elif roll < 0.14:
        body["guided_regex"] = REGEX
        feats.append("regex")
    elif roll < 0.19:
        body["guided_choice"] = CHOICES
        feats.append("choice")
    elif chat and roll < 0.34:
        body["tools"] = [WEATHER, CLOCK]
        choice = rng.choice(["none", "auto", "required", "named", None])
        if choice == "named":
            body["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
        elif choice is not None:
            body["tool_choice"] = choice
        if rng.random() < 0.5:
            body["parallel_tool_calls"] = False
        feats.append(f"tools {choice or 'default'}")
        return choice in ("required", "named")
    else:
        return False
    return True


def _draw_stop(rng: random.Random, case: Case) -> None:
    roll = rng.random()
    if roll < 0.3:
        case.probe_stop = True  # drawn from the plain output: they hit
        case.features.append("stop drawn from output")
    elif roll < 0.4:
        case.body["stop"] = [NEVER] if rng.random() < 0.5 else NEVER
        case.features.append("stop that never occurs")
    elif roll < 0.5:
        case.body["stop"] = rng.sample([".", ",", " the", "\n", "a"], rng.randint(1, 2))
        case.features.append("stop common")


def _draw_slo(rng: random.Random, case: Case) -> None:
    body, feats = case.body, case.features
    if rng.random() < 0.3:
        body["tpot_slo_ms"] = rng.choice([5.0, 60.0, 500.0])
        feats.append("tpot_slo_ms")
    if rng.random() < 0.3:
        body["ttft_slo_ms"] = rng.choice([50.0, 2000.0])
        feats.append("ttft_slo_ms")
    if rng.random() < 0.15:
        body["slo_class"] = rng.choice(["coding", "chat", "summarize"])
        feats.append("slo_class")


def stop_from(text: str, rng: random.Random) -> list[str] | None:
    """One or two substrings of an output (1-4 characters, so most span a token
    boundary), or None when it is too short."""
    if len(text) < 2:
        return None
    out = []
    for _ in range(rng.randint(1, 2)):
        n = rng.randint(1, min(4, len(text)))
        at = rng.randrange(0, len(text) - n + 1)
        piece = text[at : at + n]
        if piece.strip():
            out.append(piece)
    return out or None


# ---- sending and normalising ----------------------------------------------------------


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


def normalise(
    status: int, body: dict[str, Any] | None, events: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """Choices by index (text, tool calls without ids, finish reason, token strings,
    logprobs, top logprobs, text offsets) and usage; errors as (status, type, param)."""
    if status != 200 or (body is not None and "error" in body):
        err = (body or {}).get("error", {})
        return {"error": [status, err.get("type"), err.get("param")]}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    error = None
    for payload in [body] if body is not None else events or []:
        if "error" in payload:
            error = payload["error"]
            continue
        if payload.get("usage"):
            usage = payload["usage"]
        for c in payload.get("choices") or []:
            _merge(choices.setdefault(c["index"], _empty()), c)
    out: dict[str, Any] = {"choices": [choices[i] for i in sorted(choices)], "usage": usage}
    if error is not None:
        out["stream_error"] = [error.get("type"), error.get("param")]
    return out


def _empty() -> dict[str, Any]:
    return {
        "text": "",
        "tool_calls": [],
        "finish_reason": None,
        "tokens": [],
        "logprobs": [],
        "top": [],
        "offsets": [],
    }


def _merge(into: dict[str, Any], c: dict[str, Any]) -> None:
    msg = c.get("message") or c.get("delta")
    if msg is not None:
        into["text"] += msg.get("content") or ""
        for call in msg.get("tool_calls") or []:
            fn = call.get("function") or {}
            into["tool_calls"].append([fn.get("name"), fn.get("arguments")])
    else:
        into["text"] += c.get("text") or ""
    into["finish_reason"] = c.get("finish_reason") or into["finish_reason"]
    lp = c.get("logprobs")
    if not lp:
        return
    if "content" in lp:  # chat
        for e in lp["content"] or []:
            into["tokens"].append(e["token"])
            into["logprobs"].append(e["logprob"])
            into["top"].append({t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
    else:  # completions
        into["tokens"] += lp.get("tokens") or []
        into["logprobs"] += lp.get("token_logprobs") or []
        into["top"] += [t or {} for t in lp.get("top_logprobs") or []]
        into["offsets"] += lp.get("text_offset") or []


def compare(plain: dict[str, Any], spec: dict[str, Any]) -> tuple[list[str], float]:
    """(differences, the largest logprob gap within tolerance)."""
    gap = 0.0
    if "error" in plain or "error" in spec:
        same = plain.get("error") == spec.get("error")
        return (
            [] if same else [f"error: plain {plain.get('error')} spec {spec.get('error')}"],
            gap,
        )
    diffs: list[str] = []
    if plain["usage"] != spec["usage"]:
        diffs.append(f"usage: plain {plain['usage']} spec {spec['usage']}")
    if plain.get("stream_error") != spec.get("stream_error"):
        diffs.append(
            f"stream error: plain {plain.get('stream_error')} spec {spec.get('stream_error')}"
        )
    if len(plain["choices"]) != len(spec["choices"]):
        return [*diffs, f"choices: plain {len(plain['choices'])} spec {len(spec['choices'])}"], gap
    for i, (p, s) in enumerate(zip(plain["choices"], spec["choices"], strict=True)):
        for key in ("text", "tool_calls", "finish_reason", "tokens", "offsets"):
            if p[key] != s[key]:
                diffs.append(f"choice {i} {key}: plain {p[key]!r} spec {s[key]!r}")
        if len(p["logprobs"]) != len(s["logprobs"]):
            diffs.append(
                f"choice {i} logprobs: plain {len(p['logprobs'])} entries, spec "
                f"{len(s['logprobs'])}"
            )
            continue
        for k, (a, b) in enumerate(zip(p["logprobs"], s["logprobs"], strict=True)):
            if (a is None) != (b is None):
                diffs.append(f"choice {i} logprob {k}: plain {a} spec {b}")
            elif a is not None:
                gap = max(gap, _gap(a, b))
                if not _close(a, b):
                    diffs.append(f"choice {i} logprob {k}: plain {a} spec {b}")
        for k, (a, b) in enumerate(zip(p["top"], s["top"], strict=True)):
            bad, g = _top_differs(a, b)
            gap = max(gap, g)
            if bad:
                diffs.append(f"choice {i} top_logprobs {k}: plain {a} spec {b}")
    return diffs, gap


def _gap(a: float, b: float) -> float:
    if a == b:  # both -inf (a token the bias or grammar ruled out)
        return 0.0
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def _close(a: float, b: float) -> bool:
    return _gap(a, b) <= LOGPROB_ATOL


def _top_differs(a: dict[str, float], b: dict[str, float]) -> tuple[bool, float]:
    """Top-k lists may swap tokens tied within the tolerance at the cut: a token in one
    list only must be within LOGPROB_ATOL of the other list's smallest value."""
    if len(a) != len(b):
        return True, 0.0
    gap = 0.0
    for tok in a.keys() & b.keys():
        gap = max(gap, _gap(a[tok], b[tok]))
        if not _close(a[tok], b[tok]):
            return True, gap
    for x, y in ((a, b), (b, a)):
        for tok in x.keys() - y.keys():
            if not y or not _close(x[tok], min(y.values())):
                return True, gap
    return False, gap


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
            for candidate in _reductions(current):
                tries += 1
                if await self._differs(client, candidate):
                    current, changed = candidate, True
                    break
                if tries >= budget:
                    break
        return current


# Never dropped: the prompt, and what keeps the request deterministic (without
# `temperature` it samples at 1.0, without `seed` unseeded: the two sides then differ
# by chance, and the shrinker would chase noise).
KEEP = {"messages", "prompt", "max_tokens", "temperature", "seed"}


def _reductions(case: Case) -> Iterator[Case]:
    body = case.body

    def variant(new: dict[str, Any]) -> Case:
        return Case(case.index, case.endpoint, new, case.method, case.features)

    for key in list(body):
        if key not in KEEP:
            yield variant({k: v for k, v in body.items() if k != key})
    if body.get("temperature"):  # seeded sampling -> greedy
        drop = {"seed", "top_p", "top_k", "min_p"}
        yield variant({**{k: v for k, v in body.items() if k not in drop}, "temperature": 0.0})
    if body["max_tokens"] > 1:
        yield variant({**body, "max_tokens": body["max_tokens"] // 2})
    if body.get("n", 1) > 1:
        yield variant({**body, "n": 1})
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > 1:
        for s in stop:
            yield variant({**body, "stop": [s]})
    if "prompt" in body and len(body["prompt"]) > 4:
        yield variant({**body, "prompt": body["prompt"][: len(body["prompt"]) // 2]})
    if "messages" in body:
        msgs = body["messages"]
        if len(msgs) > 1:
            yield variant({**body, "messages": msgs[-1:]})
        text = msgs[-1]["content"]
        if len(text) > 4:
            short = copy.deepcopy(msgs)
            short[-1]["content"] = text[: len(text) // 2]
            yield variant({**body, "messages": short})


# ---- a server to fuzz -------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def all_in_one(
    log_dir: Path, args: list[str] | None = None, timeout_s: float = 600.0
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
        "0",
        "--log-dir",
        str(log_dir),
        *(args or []),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
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
