"""KV memory on demand, prefix caching and preemption, measured on the CPU server
(issue 22). Each subcommand starts `adaserve up --all-in-one` with the embedded pair and
`configs/embedded-cpu.yaml` (plus the settings it names), drives it through the OpenAI
API, reads the engine's own counters from its metrics endpoint, and prints a table.

    concurrency  8 chats without max_tokens sent at once: how many run at the same time
                 (the engine's running-requests gauge, sampled every 50 ms). Run it with
                 another tree's interpreter to compare engines on the same KV size.
    prefix       a shared 1,000-token system prompt, and multi-turn chats that resend
                 their history: TTFT p50/p90 and prompt tokens computed, prefix caching
                 on and off side by side (two servers, one after the other, same run).
    preempt      a burst that overflows a small KV cache (engine.kv_blocks): every request
                 finishes, outputs equal to a server with ample KV, preemptions counted,
                 TPOT attainment of the tight class against the relaxed one.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_kv.py prefix [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import threading
import time
from pathlib import Path

import httpx
from _server import free_port, start_up, stop_up

MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "embedded-cpu.yaml")


def server(out: Path, name: str, env: dict[str, str]) -> tuple[object, int, str]:
    port, mport = free_port(), free_port()
    args = ["--all-in-one", "--target", "embedded", "--drafter", "embedded", "--config", CONFIG]
    proc = start_up([*args, "--metrics-port", str(mport)], port, out / f"up-{name}.log", env=env)
    return proc, port, f"http://127.0.0.1:{mport}/metrics"


def metric(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created"):
            m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
            if m:
                total += float(m.group(2))
    return total


async def chat(
    client: httpx.AsyncClient, messages: list[dict], max_tokens: int | None, **extra: object
) -> dict:
    """One streaming chat: TTFT (s), the text, and the usage."""
    body: dict = {"model": MODEL, "messages": messages, "temperature": 0.0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(extra)
    t0, ttft, parts, usage, chunks = time.monotonic(), None, [], {}, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            frame = json.loads(line[6:])
            usage = frame.get("usage") or usage
            for c in frame.get("choices") or []:
                if text := (c.get("delta") or {}).get("content"):
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    chunks.append(time.monotonic())
                    parts.append(text)
    return {"ttft_s": ttft, "text": "".join(parts), "usage": usage, "chunks": chunks}


# ---- concurrency --------------------------------------------------------------------


def concurrency(args: argparse.Namespace) -> None:
    out = Path(args.out)
    proc, port, murl = server(out, "concurrency", {})
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                peak[0] = max(peak[0], metric(murl, "adaserve_num_requests_running"))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        sampler.start()

        async def go() -> list[dict]:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as c:
                # No max_tokens: the rest of the context window is each chat's limit
                # (what an engine that reserves ahead reserves); they stream until cut.
                return await asyncio.gather(
                    *(
                        chat(
                            c,
                            [{"role": "user", "content": f"Chat {i}: write a long story."}],
                            None,
                            ignore_eos=True,
                        )
                        for i in range(args.chats)
                    )
                )

        results = asyncio.run(asyncio.wait_for(go(), timeout=args.seconds))
    except TimeoutError:
        results = []
    finally:
        stop.set()
        sampler.join()
        stop_up(proc)
    print(f"{args.chats} chats without max_tokens: at most {peak[0]:.0f} running at once")
    (out / "concurrency.json").write_text(
        json.dumps({"chats": args.chats, "peak_running": peak[0], "done": len(results)})
    )


# ---- prefix -------------------------------------------------------------------------

SYSTEM_WORDS = (
    "You are the support assistant of a bicycle shop. Answer briefly and politely, "
    "recommend only products the shop sells, and never promise delivery dates. "
)


def system_prompt(words: int) -> str:
    text = ""
    k = 0
    while len(text.split()) < words:
        k += 1
        text += f"Rule {k}: {SYSTEM_WORDS}"
    return text


QUESTIONS = [
    "Do you repair flat tyres?",
    "Which helmet fits a child?",
    "Can I rent a bike for a day?",
    "How often should a chain be oiled?",
    "Do you sell electric bikes?",
    "What lights are legal at night?",
    "Can you adjust my brakes?",
    "Is a steel frame heavier than aluminium?",
]
TURNS = ["Tell me about city bikes.", "And their gears?", "What about the price?", "Thanks!"]


async def prefix_run(port: int, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as c:
        system = {"role": "system", "content": system_prompt(args.system_words)}
        shared = []
        for q in QUESTIONS:  # one after the other: each finds the previous ones' blocks
            shared.append(await chat(c, [system, {"role": "user", "content": q}], 16))
        first_turns, follow_ups = [], []
        for conv in range(args.conversations):
            history: list[dict] = []
            for t, text in enumerate(TURNS):
                history.append({"role": "user", "content": f"[{conv}] {text}"})
                res = await chat(c, history, 24)
                history.append({"role": "assistant", "content": res["text"]})
                (first_turns if t == 0 else follow_ups).append(res)
        # A first turn as long as a follow-up's new part: the history's cost excluded.
        fresh = []
        for conv in range(args.conversations):
            words = " ".join(["Tell me more, please."] * 4)
            fresh.append(await chat(c, [{"role": "user", "content": f"[new {conv}] {words}"}], 24))
    return {"shared": shared, "first": first_turns, "follow": follow_ups, "fresh": fresh}


def _ms(xs: list[dict], q: float) -> float:
    vals = sorted(r["ttft_s"] * 1000 for r in xs)
    return vals[min(len(vals) - 1, round(q / 100 * (len(vals) - 1)))]


def prefix(args: argparse.Namespace) -> None:
    out = Path(args.out)
    rows = {}
    for name, env in (
        ("cache on", {}),
        ("cache off", {"ADASERVE_ENGINE__PREFIX_CACHING": "false"}),
    ):
        proc, port, murl = server(out, name.replace(" ", "-"), env)
        try:
            q0, h0 = (metric(murl, f"adaserve_prefix_cache_{k}_total") for k in ("queries", "hits"))
            res = asyncio.run(prefix_run(port, args))
            q1, h1 = (metric(murl, f"adaserve_prefix_cache_{k}_total") for k in ("queries", "hits"))
        finally:
            stop_up(proc)
        rows[name] = {
            "res": res,
            "prompt_tokens": q1 - q0,
            "computed": (q1 - q0) - (h1 - h0),
        }
    print(
        f"shared system prompt of ~{args.system_words} words, {len(QUESTIONS)} questions; "
        f"{args.conversations} conversations of {len(TURNS)} turns (layout: --all-in-one)"
    )
    print(
        "| prefix caching | system-prompt TTFT p50 / p90 | first turn p50 | follow-up turn p50 / p90 | fresh first turn (same new tokens) p50 | prompt tokens | computed |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        r = row["res"]
        print(
            f"| {name} | {_ms(r['shared'], 50):.0f} / {_ms(r['shared'], 90):.0f} ms | "
            f"{_ms(r['first'], 50):.0f} ms | {_ms(r['follow'], 50):.0f} / {_ms(r['follow'], 90):.0f} ms | "
            f"{_ms(r['fresh'], 50):.0f} ms | {row['prompt_tokens']:.0f} | {row['computed']:.0f} |"
        )
    on = rows["cache on"]["res"]
    print(
        f"follow-up / fresh first turn TTFT (cache on): {_ms(on['follow'], 50) / _ms(on['fresh'], 50):.2f}x"
    )
    identical = all(
        a["text"] == b["text"]
        for k in ("shared", "first", "follow", "fresh")
        for a, b in zip(rows["cache on"]["res"][k], rows["cache off"]["res"][k], strict=True)
    )
    print(f"outputs identical with the cache on and off: {identical}")
    for row in rows.values():
        for group in row["res"].values():
            for r in group:
                r.pop("chunks", None)
    (out / "prefix.json").write_text(json.dumps(rows, indent=1))


# ---- preempt ------------------------------------------------------------------------


def preempt(args: argparse.Namespace) -> None:
    out = Path(args.out)
    outs, stats = {}, {}
    for name, env in (
        ("ample KV", {}),
        ("small KV", {"ADASERVE_ENGINE__KV_BLOCKS": str(args.kv_blocks)}),
    ):
        proc, port, murl = server(out, name.replace(" ", "-"), env)
        try:
            p0 = metric(murl, "adaserve_num_preemptions_total")

            async def burst(port: int = port) -> list[dict]:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as c:
                    return await asyncio.gather(
                        *(
                            chat(
                                c,
                                [{"role": "user", "content": f"Story {i}: a dragon and a knight."}],
                                args.max_tokens,
                                ignore_eos=True,
                                slo_class="coding" if i % 2 == 0 else "summarize",
                            )
                            for i in range(args.requests)
                        )
                    )

            res = asyncio.run(burst())
            stats[name] = metric(murl, "adaserve_num_preemptions_total") - p0
            slos = json.loads(httpx.get(f"http://127.0.0.1:{port}/v1/slo", timeout=10).text)
        finally:
            stop_up(proc)
        outs[name] = (res, slos)
    (ample, _), (_small, slos) = outs["ample KV"], outs["small KV"]
    classes = slos["data"][0]["classes"]
    print(
        f"{args.requests} requests of {args.max_tokens} tokens at once, half coding, half "
        f"summarize (layout: --all-in-one); small KV = {args.kv_blocks} blocks of 16"
    )
    print(
        "| KV | preemptions | all finished | outputs = ample KV | coding TPOT p50 / attained | summarize TPOT p50 / attained |"
    )
    print("|---|---|---|---|---|---|")
    for name, (res, _) in outs.items():
        row = [
            name,
            f"{stats[name]:.0f}",
            str(all(r["usage"].get("completion_tokens") == args.max_tokens for r in res)),
        ]
        row.append(str(all(a["text"] == b["text"] for a, b in zip(res, ample, strict=True))))
        for k, cls in ((0, "coding"), (1, "summarize")):
            group = [r for i, r in enumerate(res) if i % 2 == k]
            tpots = [
                (r["chunks"][-1] - r["chunks"][0]) * 1000 / (r["usage"]["completion_tokens"] - 1)
                for r in group
            ]
            slo = classes[cls]["tpot_ms"]
            row.append(
                f"{statistics.median(tpots):.0f} ms / {sum(t <= slo for t in tpots)}/{len(tpots)} (SLO {slo:.0f})"
            )
        print("| " + " | ".join(row) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("concurrency")
    c.add_argument("--chats", type=int, default=8)
    c.add_argument("--seconds", type=float, default=20.0, help="how long the chats stream")
    p = sub.add_parser("prefix")
    p.add_argument("--system-words", type=int, default=750, help="~1,000 tokens")
    p.add_argument("--conversations", type=int, default=4)
    e = sub.add_parser("preempt")
    e.add_argument("--requests", type=int, default=8)
    e.add_argument("--max-tokens", type=int, default=120)
    e.add_argument("--kv-blocks", type=int, default=40)
    for s in (c, p, e):
        s.add_argument("--out", default="out/kv")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"concurrency": concurrency, "prefix": prefix, "preempt": preempt}[args.cmd](args)


if __name__ == "__main__":
    main()
