"""The differential tester's comparison (adaserve/bench/fuzz.py): a response as the
client sees it, less ids and timing, and what differs between two of them."""

from __future__ import annotations

import math
from typing import Any

# Logprobs of the same token at the same position, from a verify forward over a tree and
# from a one-token forward: the target's float32 arithmetic in a different order (batch
# shape, blocking of the matmuls), nothing else. A float32 dot product over SmolLM2's
# hidden size d = 576 is off by about sqrt(d) * 2^-24 = 1.4e-6 relative; through 30
# layers, as a random walk, sqrt(30) times that = 8e-6; on logits up to ~30 that is
# 2.3e-4, and a log-softmax moves by at most twice its largest logit's error: 5e-4.
# 1e-3 is twice that estimate (measured: at most 1.9e-5 over 147 cases in 10 minutes),
# and far below what a real defect moves (a wrong position or token: tenths or more).
LOGPROB_ATOL = 1e-3


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
    if body is not None and body.get("prompt_logprobs") is not None:  # chat: response-level
        out["prompt_logprobs"] = body["prompt_logprobs"]
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
        "prompt_logprobs": None,
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
    if c.get("prompt_logprobs") is not None:  # completions: per choice
        into["prompt_logprobs"] = c["prompt_logprobs"]
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
    bad, g = _prompt_differs(plain.get("prompt_logprobs"), spec.get("prompt_logprobs"))
    gap = max(gap, g)
    if bad:
        diffs.append("prompt_logprobs differ")
    for i, (p, s) in enumerate(zip(plain["choices"], spec["choices"], strict=True)):
        bad, g = _prompt_differs(p["prompt_logprobs"], s["prompt_logprobs"])
        gap = max(gap, g)
        if bad:
            diffs.append(f"choice {i} prompt_logprobs differ")
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


def _prompt_differs(a: list | None, b: list | None) -> tuple[bool, float]:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id:
    {logprob, rank, decoded_token}}; the same ids, ranks and text, logprobs within the
    tolerance (a top-k entry may swap with one tied at the cut, as top_logprobs)."""
    if a is None or b is None:
        return (a is None) != (b is None), 0.0
    if len(a) != len(b):
        return True, 0.0
    gap = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                return True, gap
            continue
        bad, g = _top_differs(
            {t: e["logprob"] for t, e in x.items()}, {t: e["logprob"] for t, e in y.items()}
        )
        gap = max(gap, g)
        if bad:
            return True, gap
        for t in x.keys() & y.keys():
            if x[t].get("decoded_token") != y[t].get("decoded_token"):
                return True, gap
    return False, gap
