"""End-to-end tokens/s of the speculative server against the same stack with
speculation off (issue 6), at several concurrency levels, greedy, same prompts.

Starts `adaserve up --all-in-one` twice on loopback (embedded drafter, and
`--drafter none`), sends `concurrency` chat requests at once through the
OpenAI-compatible API, `repeats` times to each server in alternation (round k starts
at prompt k * concurrency, so one request walks through the prompts), and reports
median tokens/s and the median of the per-round ratios (each speculative round over the
plain round right after it: on a shared host whose speed drifts from minute to minute,
adjacent rounds see the same machine).
Outputs must be token-identical between the two servers (the lossless invariant);
the script says so when they are not.

`--plain-cpu-kernel mkl` adds a third server, speculation off on MKL's linear layers
instead of the packed kernel (adaserve/model/cpu_gemm.py), which is MKL's own best case
for one token: the speculative server is then also compared with that.

`--separate` adds a speculative server in the layout `make up` starts (a verifier, a
drafter and a scheduler process; without `--all-in-one`), so both layouts are compared
with the same plain server in one run; `--separate default passive` adds a second one
with every service's OpenMP threads asleep between ops (OMP_WAIT_POLICY=PASSIVE, what
`make up` did before 0.7.0).

`--methods model ngram auto` sends each round once per speculation method to the same
speculative server (the request field `speculation.method`; adaserve/methods.py), each
compared with the plain server; without it the server's default method is used (mode
`speculative`). The plain server runs with speculation off altogether (no drafter, no
n-gram drafter). `--category summarize|coding|chat|qa` takes the first 8 prompts of that
category from the held-out distillation prompts (summaries carry their source text)
instead of the built-in 8 chat prompts.

    .venv/bin/python benchmarks/bench_spec_server.py [--concurrency 1 8] [--max-tokens 96]
        [--plain-cpu-kernel mkl] [--methods model ngram auto] [--category summarize]
        [--separate [default passive]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from _server import free_port, start_up, stop_up

HELDOUT = Path(__file__).parents[1] / "adaserve" / "distill" / "prompts" / "heldout.jsonl"
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


def prompt_set(category: str | None) -> list[list[dict]]:
    """Chat messages of the 8 prompts a run walks."""
    if category is None:
        return [[{"role": "user", "content": p}] for p in PROMPTS]
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    picked = [r["messages"] for r in rows if r.get("category") == category][:8]
    if not picked:
        raise SystemExit(f"no held-out prompts of category {category!r}")
    return picked


async def one_round(
    port: int,
    concurrency: int,
    max_tokens: int,
    first: int = 0,
    method: str | None = None,
    prompts: list[list[dict]] | None = None,
    ignore_eos: bool = True,
) -> tuple[float, int, list[str]]:
    prompts = prompts or prompt_set(None)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:

        async def ask(i: int) -> tuple[int, str]:
            body = {
                "model": "SmolLM2-135M-Instruct",
                "messages": prompts[(first + i) % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": ignore_eos,
                "tpot_slo_ms": 1000.0,
            }
            if method is not None:
                body["speculation"] = {"method": method}
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            body = r.json()
            return body["usage"]["completion_tokens"], body["choices"][0]["message"]["content"]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(ask(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return elapsed, sum(n for n, _ in results), [t for _, t in results]


COUNTERS = {
    "adaserve_spec_decode_method_steps_total": "steps",
    "adaserve_spec_decode_method_emitted_tokens_total": "emitted",
    "adaserve_spec_decode_method_draft_tokens_total": "draft",
    "adaserve_spec_decode_method_accepted_tokens_total": "accepted",
}


def method_counters(url: str) -> dict[str, float]:
    """{"steps/ngram": ..., "emitted/ngram": ...} from an engine's metrics endpoint."""
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        name, _, rest = line.partition('{method="')
        if name in COUNTERS and rest:
            method, _, value = rest.partition('"} ')
            out[f"{COUNTERS[name]}/{method}"] = float(value)
    return out


def step_summary(delta: dict[str, float]) -> dict:
    """Tokens per verification step (a request's, bonus included) and the share of
    steps each source drafted, from counter differences."""
    total = {
        k: sum(v for key, v in delta.items() if key.startswith(k + "/")) for k in COUNTERS.values()
    }
    sources = {
        key.split("/", 1)[1]: round(v / total["steps"], 2)
        for key, v in sorted(delta.items())
        if key.startswith("steps/") and v > 0
    }
    return {
        "tokens_per_step": total["emitted"] / total["steps"] if total["steps"] else 1.0,
        "acceptance": total["accepted"] / total["draft"] if total["draft"] else 0.0,
        "sources": sources,
    }


def walk_ratios(spec: dict, base: dict, rounds_per_pass: int) -> list[float]:
    """Per pass through the prompts (one request walks them over several rounds), the
    speculative server's tokens/s over the whole pass against the baseline's. A round's
    ratio is one prompt's: their median is the middle prompt's speed-up, while a user
    sending all of them gets this one."""
    out = []
    for k in range(0, len(spec["tokens"]) - rounds_per_pass + 1, rounds_per_pass):
        window = slice(k, k + rounds_per_pass)
        rate = {
            name: sum(row["tokens"][window]) / sum(row["elapsed_s"][window])
            for name, row in (("spec", spec), ("base", base))
        }
        out.append(rate["spec"] / rate["base"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drafter", default="embedded")
    p.add_argument("--out", default="out/bench_spec_server")
    p.add_argument(
        "--config",
        default="configs/embedded-cpu.yaml",
        help="settings YAML for both servers ('' for the defaults)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=["auto", "model", "eagle", "ngram", "none"],
        default=None,
        help="speculation methods to send to the speculative server (default: its own)",
    )
    p.add_argument(
        "--category",
        choices=["summarize", "coding", "chat", "qa"],
        default=None,
        help="held-out prompts of this category instead of the built-in chat prompts",
    )
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end each answer at end-of-text (default: ignore it, every round the same "
        "length; the text past it repeats itself, which flatters the n-gram drafter)",
    )
    p.add_argument(
        "--plain-cpu-kernel",
        choices=["mkl"],
        default=None,
        help="also run speculation off with this CPU linear kernel",
    )
    p.add_argument(
        "--separate",
        nargs="*",
        choices=["default", "passive"],
        default=None,
        help="also a speculative server in the separate-process layout (`make up`); "
        "passive: with OMP_WAIT_POLICY=PASSIVE in every service",
    )
    args = p.parse_args()

    results: dict = {"load_before": os.getloadavg(), "rows": [], "category": args.category}
    texts: dict[tuple[str, int], list[str]] = {}
    extra = ["--config", args.config] if args.config else []
    prompts = prompt_set(args.category)
    # Both servers stay up and rounds alternate (speculative, plain, speculative, ...):
    # an idle server costs nothing, and load drifts on a shared machine hit both alike.
    # Plain: no speculation at all (no drafter, and the n-gram drafter off).
    off = {"ADASERVE_SPECULATION__NGRAM__ENABLED": "false"}
    servers = {"speculative": args.drafter, "plain": "none"}
    env: dict[str, dict[str, str]] = {"plain": off}
    if args.plain_cpu_kernel:
        other = f"plain-{args.plain_cpu_kernel}"
        servers[other] = "none"
        env[other] = {**off, "ADASERVE_MODEL__CPU_KERNEL": args.plain_cpu_kernel}
    # The separate-process layout's servers: speculative modes of their own.
    variants = [] if args.separate is None else (args.separate or ["default"])
    separate = {("separate" if v == "default" else f"separate-{v}"): v for v in variants}
    for name, variant in separate.items():
        servers[name] = args.drafter
        if variant == "passive":
            env[name] = {"OMP_WAIT_POLICY": "PASSIVE"}
    # mode -> (server, method): each method is a mode on the one speculative server.
    spec_modes = {m: ("speculative", m) for m in args.methods} if args.methods else {}
    spec_modes = spec_modes or {"speculative": ("speculative", None)}
    spec_modes |= {name: (name, None) for name in separate}
    modes = {**spec_modes, **{name: (name, None) for name in servers if name != "speculative"}}
    ports: dict[str, int] = {}
    metrics_urls: dict[str, str] = {}
    procs: dict[str, subprocess.Popen] = {}
    # Per mode and concurrency: the engine's per-method counters over its own rounds
    # (rounds run one at a time, so the differences are that mode's): load-free.
    steps: dict[tuple[str, int], dict[str, float]] = {}
    try:
        for name, drafter in servers.items():
            # picked only now: the first server's services take free ports as they start
            ports[name] = free_port()
            layout = [] if name in separate else ["--all-in-one"]
            up_args = [*layout, "--target", "embedded", "--drafter", drafter, *extra]
            # each server its own engine metrics port (the default 9400 would collide)
            metrics_port = free_port()
            metrics_urls[name] = f"http://127.0.0.1:{metrics_port}/metrics"
            up_args += ["--metrics-port", str(metrics_port)]
            log = Path(args.out) / f"up-{name}.log"
            procs[name] = start_up(up_args, ports[name], log, env=env.get(name))
            # Warm-up, and every prompt once into the prefix cache: otherwise the mode
            # that sends a prompt first pays its prefill and the later ones do not.
            asyncio.run(one_round(ports[name], len(prompts), 1, prompts=prompts))
        for c in args.concurrency:
            rates: dict[str, list[float]] = {mode: [] for mode in modes}
            spent: dict[str, list[tuple[int, float]]] = {mode: [] for mode in modes}
            for k in range(args.repeats):
                for mode, (server, method) in modes.items():
                    # round k starts at prompt k * c: one request does not measure one prompt
                    before = method_counters(metrics_urls[server])
                    elapsed, tokens, out = asyncio.run(
                        one_round(
                            ports[server],
                            c,
                            args.max_tokens,
                            k * c,
                            method,
                            prompts,
                            not args.stop_at_eos,
                        )
                    )
                    after = method_counters(metrics_urls[server])
                    acc = steps.setdefault((mode, c), {})
                    for key, value in after.items():
                        acc[key] = acc.get(key, 0.0) + value - before.get(key, 0.0)
                    rates[mode].append(tokens / elapsed)
                    spent[mode].append((tokens, elapsed))
                    texts[(mode, c)] = out
            for mode in modes:
                per_step = step_summary(steps.get((mode, c), {}))
                results["rows"].append(
                    {
                        "mode": mode,
                        "concurrency": c,
                        "tokens_per_s_median": statistics.median(rates[mode]),
                        "tokens_per_s": rates[mode],
                        "tokens": [n for n, _ in spent[mode]],
                        "elapsed_s": [t for _, t in spent[mode]],
                        **per_step,
                    }
                )
                print(
                    f"{mode:12s} concurrency {c:3d}: {statistics.median(rates[mode]):7.1f} tok/s "
                    f"(runs {', '.join(f'{r:.1f}' for r in rates[mode])}); "
                    f"{per_step['tokens_per_step']:.2f} tokens per step, "
                    f"trees from {per_step['sources']}",
                    flush=True,
                )
    finally:
        for proc in procs.values():
            stop_up(proc)
    for base in [m for m in servers if m != "speculative" and m not in separate]:
        print(
            f"\n{'mode':>12s}  concurrency  tok/s  {base:>9s}   ratio  walk ratio  identical output"
        )
        for mode in spec_modes:
            for c in args.concurrency:
                rows = {r["mode"]: r for r in results["rows"] if r["concurrency"] == c}
                spec, plain = rows[mode], rows[base]
                ratio = statistics.median(
                    a / b for a, b in zip(spec["tokens_per_s"], plain["tokens_per_s"], strict=True)
                )
                walks = walk_ratios(spec, plain, max(1, len(prompts) // c))
                walk = statistics.median(walks) if walks else math.nan  # no whole pass
                same = texts[(mode, c)] == texts[(base, c)]
                results.setdefault("summary", []).append(
                    {
                        "mode": mode,
                        "concurrency": c,
                        "baseline": base,
                        "ratio": ratio,
                        "walk_ratio": walk,
                        "identical": same,
                    }
                )
                print(
                    f"{mode:>12s}  {c:11d}  {spec['tokens_per_s_median']:5.1f}  "
                    f"{plain['tokens_per_s_median']:9.1f}  {ratio:5.2f}  {walk:10.2f}  {same}"
                )
    print(
        "(ratio: median over rounds of speculative / the baseline round beside it;\n"
        " walk ratio: median over passes through the prompt set of the two servers'\n"
        " tokens/s over the whole pass, i.e. every prompt weighted by its time)"
    )
    results["load_after"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nload average before {results['load_before']}, after {results['load_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
