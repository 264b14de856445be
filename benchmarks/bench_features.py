"""What the OpenAI features of issue 24 cost on the speculative CPU server: tokens/s
with and without logprobs, penalties and a JSON schema, at 1 and 8 concurrent requests,
in one run on one server, as ratios to plain requests of the same round; and what
structured output does to speculation: tokens per verification (accepted drafted
tokens + the bonus, per drafted tree) and draft acceptance, against unconstrained.

Starts `adaserve up --all-in-one --target embedded --drafter embedded` with the CPU
settings, then, per concurrency c, one untimed pass of every variant and rounds of c
chat requests; each round runs every variant in turn (so the host's drift hits them
alike), round k starting with variant k and at prompt k * c. The
speculation numbers are the engine's counters (`adaserve_spec_decode_*`) read before
and after each variant's 1-request rounds. Greedy throughout; the JSON variant stops
when its object is complete (the others run to max_tokens with ignore_eos; it has
max_tokens 256, room for the whole object), so at 8 requests its batch thins out at the
end of a round.

    .venv/bin/python benchmarks/bench_features.py [--concurrency 1 8] [--rounds 5]
    .venv/bin/python benchmarks/bench_features.py --smoke   # 1 round, 1 request, 8 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx
import jsonschema
from _server import free_port, start_up, stop_up

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash table is in three sentences.",
    "Give me a short recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Write a haiku about autumn leaves.",
    "List five tips for writing clean code.",
    "How does a bicycle stay upright?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "answer": {"type": "string", "maxLength": 200},
        "confidence": {"enum": ["low", "medium", "high"]},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["topic", "answer", "confidence", "keywords"],
    "additionalProperties": False,
}
VARIANTS = {
    "plain": {"ignore_eos": True},
    "logprobs (top 5)": {"ignore_eos": True, "logprobs": True, "top_logprobs": 5},
    "penalties": {
        "ignore_eos": True,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
    "logit_bias + min_p": {
        "ignore_eos": True,
        "logit_bias": {"13": -5.0, "28": 2.0},
        "min_p": 0.05,
    },
    # Its own max_tokens, enough for the whole object: a cut one would not validate.
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        "max_tokens": 256,
    },
}
COUNTERS = {
    "drafts": "adaserve_spec_decode_num_drafts_total",
    "emitted": "adaserve_spec_decode_num_emitted_tokens_total",
    "drafted": "adaserve_spec_decode_num_draft_tokens_total",
    "accepted": "adaserve_spec_decode_num_accepted_tokens_total",
}


async def one_round(
    port: int, model: str, concurrency: int, max_tokens: int, extra: dict, first: int
) -> tuple[float, list[int], list[str]]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:

        async def ask(i: int) -> tuple[int, str]:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": PROMPTS[(first + i) % len(PROMPTS)]}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "tpot_slo_ms": 1000.0,
                **extra,
            }
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            out = r.json()
            return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(ask(i) for i in range(concurrency)))
    return time.perf_counter() - t0, [n for n, _ in results], [t for _, t in results]


def counters(metrics_port: int) -> dict[str, float]:
    """The engine's speculation counters (0 for one not yet created)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return {k: float(values.get(name, 0.0)) for k, name in COUNTERS.items()}


def summarize(rates: dict[str, list[float]], spec: dict[str, dict[str, float]]) -> list[dict]:
    """Per variant: median tok/s, the median over rounds of its tok/s over plain's in the
    same round, and (where it drafted) tokens per verification and draft acceptance."""
    rows = []
    for name, runs in rates.items():
        ratios = [r / p for r, p in zip(runs, rates["plain"], strict=True) if p > 0]
        c = spec.get(name, {})
        rows.append(
            {
                "variant": name,
                "tokens_per_s_median": statistics.median(runs),
                "tokens_per_s": runs,
                "ratio_to_plain_median": statistics.median(ratios) if ratios else None,
                "tokens_per_verification": (
                    c["emitted"] / c["drafts"] if c.get("drafts") else None
                ),
                "draft_acceptance": c["accepted"] / c["drafted"] if c.get("drafted") else None,
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--config", default="configs/embedded-cpu.yaml")
    p.add_argument("--out", default="out/bench_features")
    p.add_argument("--smoke", action="store_true", help="1 round of 1 request, 8 tokens")
    args = p.parse_args()
    if args.smoke:
        args.concurrency, args.rounds, args.max_tokens = [1], 1, 8

    port, metrics_port = free_port(), free_port()
    up = ["--all-in-one", "--target", "embedded", "--drafter", "embedded"]
    up += ["--metrics-port", str(metrics_port), "--config", args.config]
    results: dict = {"args": vars(args), "load_before": os.getloadavg(), "rows": []}
    proc = start_up(up, port, Path(args.out) / "up.log")
    valid = invalid = 0
    try:
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
        for c in args.concurrency:
            # Untimed: each variant once at this concurrency (batch shapes, grammar
            # compilation, the prompts in the prefix cache), so round 0 is not a warm-up.
            for extra in VARIANTS.values():
                asyncio.run(one_round(port, model, c, args.max_tokens, extra, first=0))
            rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
            spec: dict[str, dict[str, float]] = {v: dict.fromkeys(COUNTERS, 0.0) for v in VARIANTS}
            names = list(VARIANTS)
            for k in range(args.rounds):
                # Each round starts with another variant: none is always first after a
                # switch of prompts, or always runs beside the same phase of the host's load.
                for name in names[k % len(names) :] + names[: k % len(names)]:
                    extra = VARIANTS[name]
                    before = counters(metrics_port)
                    elapsed, tokens, texts = asyncio.run(
                        one_round(port, model, c, args.max_tokens, extra, first=k * c)
                    )
                    after = counters(metrics_port)
                    rates[name].append(sum(tokens) / elapsed)
                    for key in COUNTERS:
                        spec[name][key] += after[key] - before[key]
                    if name == "json_schema":
                        for t in texts:
                            try:
                                jsonschema.validate(json.loads(t), SCHEMA)
                                valid += 1
                            except (ValueError, jsonschema.ValidationError):
                                invalid += 1
            for row in summarize(rates, spec if c == 1 else {}):
                results["rows"].append({"concurrency": c, **row})
                tpv, acc = row["tokens_per_verification"], row["draft_acceptance"]
                print(
                    f"c={c} {row['variant']:18s} {row['tokens_per_s_median']:6.1f} tok/s "
                    f"x{row['ratio_to_plain_median']:.2f} of plain "
                    f"(runs {', '.join(f'{r:.1f}' for r in row['tokens_per_s'])})"
                    + (f"  {tpv:.2f} tokens/verification, acceptance {acc:.2f}" if tpv else ""),
                    flush=True,
                )
    finally:
        stop_up(proc)
    results["json_valid"] = [valid, valid + invalid]
    results["load_after"] = os.getloadavg()
    print(f"json_schema outputs that validate: {valid}/{valid + invalid}")
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0 if invalid == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
