"""Where a served iteration's time goes, per layout and concurrency (issue 32: host +
select + RPC <= 10% of the iteration at 1 request in `--all-in-one`, <= 20% in separate
processes).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/peers/host_share.py --out out/host_share

Each layout (`adaserve up --all-in-one` and `adaserve up`, `make up`'s settings) is
started in turn. At each concurrency, after a warm-up round, `--rounds` rounds of the
peers' chat request (benchmarks/peers/run.py: 42 prompt tokens, 128 greedy tokens) go to
/v1/completions, and the engine's `adaserve_iteration_seconds{phase}` is read from its
metrics port before and after. Per decode iteration:

- host: intake, admission, stop checks, detokenizing, streaming (outside the phases);
- speculate: planning up to the drafters' answers (separate layout: the drafter RPC);
- select: tree selection (separate layout: the scheduler RPC), grammar, KV fit;
- verify: the target's forward and the acceptance.

The iteration is their sum. The control plane's share is host + select, and in the
separate layout also the drafter RPC's cost, estimated as the speculate time per
iteration above the all-in-one's at the same concurrency (an upper bound where the two
plans draft differently). Where the time goes inside each process: flame.py beside this.
Writes OUT/host_share.md and OUT/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks._server, benchmarks.peers.run from any directory

from benchmarks._server import free_port, start_up, stop_up  # noqa: E402
from benchmarks.peers.run import decode_round, prompt_ids  # noqa: E402

PHASES = ("host", "speculate", "select", "verify")
LAYOUTS = {"aio": ["--all-in-one"], "separate": []}


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {phase: seconds summed, `count:phase`: iterations observed}."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "adaserve_iteration_seconds":
            continue
        for sample in fam.samples:
            phase = sample.labels.get("phase", "")
            if sample.name.endswith("_sum"):
                out[phase] = sample.value
            elif sample.name.endswith("_count"):
                out[f"count:{phase}"] = sample.value
    return out


def scrape(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        return parse(r.read().decode())


def measure(url: str, metrics_url: str, ids: list[int], c: int, args) -> dict:
    asyncio.run(decode_round(url, ids, c, args.max_tokens))  # warm-up
    before, t0 = scrape(metrics_url), time.perf_counter()
    for _ in range(args.rounds):
        asyncio.run(decode_round(url, ids, c, args.max_tokens))
    wall, after = time.perf_counter() - t0, scrape(metrics_url)
    iters = after.get("count:verify", 0.0) - before.get("count:verify", 0.0)
    tokens = args.rounds * c * args.max_tokens  # decode_round checks every count
    return {
        "iterations": iters,
        "tok_s": tokens / wall,
        "tokens_per_iteration": tokens / max(iters, 1.0),
        "ms_per_iteration": {
            p: 1000.0 * (after.get(p, 0.0) - before.get(p, 0.0)) / max(iters, 1.0) for p in PHASES
        },
    }


def control_share(ms: dict[str, float], aio_ms: dict[str, float] | None) -> float:
    """(host + select [+ the drafter RPC: speculate above the all-in-one's]) / iteration."""
    control = ms["host"] + ms["select"]
    if aio_ms is not None:
        control += max(ms["speculate"] - aio_ms["speculate"], 0.0)
    total = sum(ms.values())
    return control / total if total else 0.0


def table(results: dict) -> str:
    rows = [
        f"`benchmarks/peers/host_share.py`, {results['date']}, `{results['config']}`, "
        f"{results['rounds']} rounds; ms per decode iteration from the engine's "
        "`adaserve_iteration_seconds{phase}`.",
        "",
        "| layout | requests | tok/s | tokens / iteration | host | speculate | select "
        "| verify | control plane |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_c in results["layouts"].items():
        for c, r in by_c.items():
            ms = r["ms_per_iteration"]
            rows.append(
                f"| {name} | {c} | {r['tok_s']:.1f} | {r['tokens_per_iteration']:.2f} | "
                + " | ".join(f"{ms[p]:.2f}" for p in PHASES)
                + f" | {r['control_share']:.1%} |"
            )
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/host_share")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--config", default="configs/embedded-cpu.yaml")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = prompt_ids()
    results: dict = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "config": args.config,
        "rounds": args.rounds,
        "layouts": {},
    }
    for name in args.layouts:
        port, mport = free_port(), free_port()
        up = ["--target", "embedded", "--drafter", "embedded", "--config", args.config]
        up += ["--metrics-port", str(mport), *LAYOUTS[name]]
        print(f"{name}: starting", flush=True)
        proc = start_up(up, port, out / name / "server.log")
        try:
            url, murl = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"
            for c in args.concurrency:
                r = measure(url, murl, ids, c, args)
                results["layouts"].setdefault(name, {})[str(c)] = r
                print(f"  {name} @ {c}: {r['tok_s']:.1f} tok/s", flush=True)
        finally:
            stop_up(proc)
    aio = results["layouts"].get("aio", {})
    for name, by_c in results["layouts"].items():
        for c, r in by_c.items():
            ref = aio[c]["ms_per_iteration"] if name != "aio" and c in aio else None
            r["control_share"] = control_share(r["ms_per_iteration"], ref)
    md = table(results)
    (out / "host_share.md").write_text(md)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(md)


if __name__ == "__main__":
    main()
