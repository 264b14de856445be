"""What a long prompt does to the streams already running (issue 21's stall measure).

Starts the CPU server as `make up` does (separate processes; `--all-in-one` for one
process), streams two chat requests, and once they are decoding sends a prompt of
`--prompt-tokens` tokens (2,000 by default). Each stream's inter-chunk gaps are split
into before the prompt arrives, while it is prefilled (until its first token), and
after. Then the same with the prompt prefilled whole in one forward, as the engine did
before the unified iteration (`engine.min_prefill_tokens` = `engine.max_batch_tokens` =
the prompt's length), side by side on the same machine in the same run. Each stream's
output must equal the one it gets alone (the lossless invariant under chunking).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_stall.py [--all-in-one]
        [--prompt-tokens 2000] [--out benchmarks/results/stall]

Prints a table, writes `stall.json` and `stall.png` (each stream's gaps over time, the
prefill shaded).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from pathlib import Path

import httpx
from _server import free_port, start_up, stop_up

MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parent.parent
STREAM_PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain in detail how a compiler turns source code into machine code.",
]


async def stream_chat(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """One streaming chat request: arrival time of every content chunk, and the text."""
    times, parts = [], []
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[6:])
            choices = frame.get("choices") or []
            if choices and (text := choices[0].get("delta", {}).get("content")):
                times.append(time.monotonic())
                parts.append(text)
    return {"times": times, "text": "".join(parts)}


async def long_prompt(client: httpx.AsyncClient, n: int) -> dict:
    """A completion of an n-token prompt (token ids, so its length is exact)."""
    ids = [1000 + (37 * i) % 20000 for i in range(n)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0.0, "stream": True}
    sent, first = time.monotonic(), None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                frame = json.loads(line[6:])
                if (frame.get("choices") or [{}])[0].get("text"):
                    first = time.monotonic()
    return {"sent": sent, "first_token": first}


async def scenario(port: int, args: argparse.Namespace, interfere: bool) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        streams = [
            asyncio.create_task(stream_chat(client, p, args.max_tokens)) for p in STREAM_PROMPTS
        ]
        t0 = time.monotonic()
        prompt = None
        if interfere:
            await asyncio.sleep(args.lead_s)  # both streams decoding by now
            prompt = await long_prompt(client, args.prompt_tokens)
        results = await asyncio.gather(*streams)
    return {"t0": t0, "streams": results, "prompt": prompt}


def gaps(run: dict) -> list[dict]:
    """Per stream: median gap before the prompt arrived, worst gap while it was
    prefilled, median after, all in ms."""
    p = run["prompt"]
    out = []
    for s in run["streams"]:
        t = s["times"]
        before, during, after = [], [], []
        for a, b in itertools.pairwise(t):
            g = (b - a) * 1000.0
            if b <= p["sent"]:
                before.append(g)
            elif a >= p["first_token"]:
                after.append(g)
            else:
                during.append(g)
        out.append(
            {
                "median_before_ms": statistics.median(before) if before else None,
                "worst_before_ms": max(before) if before else None,
                "median_during_ms": statistics.median(during) if during else None,
                "p90_during_ms": _pct(during, 90),
                "worst_during_ms": max(during) if during else None,
                "median_after_ms": statistics.median(after) if after else None,
                "chunks_during": len(during),
            }
        )
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def measure(args: argparse.Namespace, name: str, env: dict[str, str], out: Path) -> dict:
    port = free_port()
    layout = ["--all-in-one"] if args.all_in_one else []
    up = [
        "--target",
        "embedded",
        "--drafter",
        "embedded",
        "--config",
        str(REPO / "configs" / "embedded-cpu.yaml"),
        *layout,
    ]
    proc = start_up(up, port, out / f"up-{name.split()[0]}.log", env=env)
    try:
        alone = asyncio.run(scenario(port, args, interfere=False))
        mixed = asyncio.run(scenario(port, args, interfere=True))
    finally:
        stop_up(proc)
    identical = [
        a["text"] == m["text"] for a, m in zip(alone["streams"], mixed["streams"], strict=True)
    ]
    p = mixed["prompt"]
    return {
        "config": name,
        "env": env,
        "ttft_ms": (p["first_token"] - p["sent"]) * 1000.0,
        "streams": gaps(mixed),
        "identical_to_alone": identical,
        "raw": mixed,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 3.2 * len(results)), sharex=True)
    for ax, res in zip(axes, results, strict=True):
        raw = res["raw"]
        t0, p = raw["t0"], raw["prompt"]
        for i, s in enumerate(raw["streams"]):
            t = s["times"]
            ax.plot(
                [b - t0 for b in t[1:]],
                [(b - a) * 1000 for a, b in itertools.pairwise(t)],
                ".-",
                ms=3,
                lw=0.8,
                label=f"stream {i + 1}",
            )
        ax.axvspan(
            p["sent"] - t0, p["first_token"] - t0, color="orange", alpha=0.25, label="prefill"
        )
        ax.set_yscale("log")
        ax.set_ylabel("gap between chunks (ms)")
        ax.set_title(f"{res['config']}: TTFT of the long prompt {res['ttft_ms'] / 1000:.1f} s")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds since the streams started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=800, help="tokens each stream generates")
    ap.add_argument("--lead-s", type=float, default=3.0, help="streams run this long first")
    ap.add_argument("--all-in-one", action="store_true", help="one process (default: as make up)")
    ap.add_argument("--out", default="out/stall")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    whole = str(args.prompt_tokens)
    configs = [
        ("chunked (unified iteration)", {}),
        (
            "whole prompt in one forward",
            {
                "ADASERVE_ENGINE__MAX_BATCH_TOKENS": whole,
                "ADASERVE_ENGINE__MIN_PREFILL_TOKENS": whole,
            },
        ),
    ]
    results = [measure(args, name, env, out) for name, env in configs]
    layout = "--all-in-one" if args.all_in_one else "separate processes (make up)"
    print(f"layout: {layout}; prompt {args.prompt_tokens} tokens; 2 streams of {args.max_tokens}")
    print(
        "| config | stream | gap before: median / worst | during prefill: median / p90 / worst "
        "| worst / median before | after: median | TTFT of the prompt | output = alone |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        for i, s in enumerate(res["streams"]):
            before, worst = s["median_before_ms"], s["worst_during_ms"]
            ratio = f"{worst / before:.2f}x" if before and worst else "-"
            print(
                f"| {res['config']} | {i + 1} | {_ms(before)} / {_ms(s['worst_before_ms'])} | "
                f"{_ms(s['median_during_ms'])} / {_ms(s['p90_during_ms'])} / {_ms(worst)} | "
                f"{ratio} | {_ms(s['median_after_ms'])} | {res['ttft_ms'] / 1000:.2f} s | "
                f"{res['identical_to_alone'][i]} |"
            )
    (out / "stall.json").write_text(json.dumps({"layout": layout, "results": results}, indent=1))
    plot(results, out / "stall.png")
    print(f"wrote {out / 'stall.json'} and {out / 'stall.png'}")


if __name__ == "__main__":
    main()
