"""`adaserve demo`: drive a running server with a mixed three-class SLO workload.

Open-loop Poisson arrivals of real chat prompts (coding, chat, summarize), each sent
with its `slo_class`, streamed through the OpenAI-compatible API. Prints a per-class
table (TTFT, TPOT, SLO attainment, goodput, tokens per verification step) and writes
a PNG of every request's TPOT against its class's SLO. The point to see: under load
the tight class gets lower TPOT than the relaxed one, from the same server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from adaserve.demo_prompts import BY_CLASS, MAX_TOKENS, long_document
from adaserve.sim.summary import RequestRecord, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    # 1.5 req/s is where the classes separate on a 2-core CPU (docs/OPERATIONS.md): at 0.5 every
    # request is far under its SLO and the classes look alike.
    p.add_argument(
        "--rps",
        type=float,
        default=None,
        help="mean request rate (Poisson); default 1.5, or 0.3 with --long-prompts (on a "
        "2-core CPU a 3k-token document takes ~6 s to prefill)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument(
        "--mix",
        default="coding=0.34,chat=0.33,summarize=0.33",
        help="class weights, e.g. coding=0.6,chat=0.2,summarize=0.2",
    )
    p.add_argument(
        "--max-tokens-scale",
        type=float,
        default=1.0,
        help="multiply each class's max_tokens (96/64/48)",
    )
    p.add_argument(
        "--long-prompts",
        action="store_true",
        help="summarize sends a 2k-4k-token document (prefill beside the decoding streams)",
    )
    p.add_argument("--seed", type=int, default=0, help="arrivals, classes and prompts")
    p.add_argument("--api-key", default=None, help="bearer token, if the gateway wants one")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--out", default="out/demo", help="folder for summary.json and tpot.png")


def run(args: argparse.Namespace) -> int:
    if args.rps is None:
        args.rps = 0.3 if args.long_prompts else 1.5
    if args.rps <= 0:
        print("adaserve demo: --rps must be positive", file=sys.stderr)
        return 2
    try:
        mix = _parse_mix(args.mix)
    except ValueError as exc:
        print(f"adaserve demo: {exc}", file=sys.stderr)
        return 2
    try:
        records, chunks = asyncio.run(_drive(args, mix))
    except httpx.HTTPError as exc:
        print(f"adaserve demo: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    summary = summarize(records, policy="server", rps=args.rps)
    for name, group in summary["per_class"].items():
        rs = [r for r in records if r.slo_class == name and r.id in chunks]
        steps = sum(chunks[r.id] for r in rs)
        group["mean_accepted"] = sum(r.num_tokens for r in rs) / steps if steps else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "requests.json").write_text(json.dumps([r.to_dict() for r in records], indent=1))
    print(format_table(summary))
    plot_path = _plot(records, out / "tpot.png", args.rps)
    print(f"\nwrote {out / 'summary.json'} and {plot_path}")
    failed = sum(r.finish_reason not in ("stop", "length") for r in records)
    if failed:
        print(f"{failed} request(s) failed; see {out / 'requests.json'}", file=sys.stderr)
    return 0


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, w = part.partition("=")
        name = name.strip()
        if name not in BY_CLASS:
            raise ValueError(f"unknown class {name!r} in --mix (one of {', '.join(BY_CLASS)})")
        mix[name] = float(w)
    if sum(mix.values()) <= 0:
        raise ValueError("--mix weights must sum to a positive number")
    return mix


async def _drive(args, mix: dict[str, float]) -> tuple[list[RequestRecord], dict[str, int]]:
    rng = np.random.default_rng(args.seed)
    names = list(mix)
    weights = np.array([mix[n] for n in names]) / sum(mix.values())
    arrivals, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / args.rps)
        if t > args.duration:
            break
        cls = names[rng.choice(len(names), p=weights)]
        prompt = BY_CLASS[cls][rng.integers(len(BY_CLASS[cls]))]
        if args.long_prompts and cls == "summarize":
            # ~1.3 tokens a word: 1,550-3,100 words are 2k-4k tokens
            prompt = long_document(int(rng.integers(1 << 30)), int(rng.integers(1550, 3100)))
        arrivals.append((t, cls, prompt))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chunks: dict[str, int] = {}
    status = _Status(len(arrivals))
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=600.0, limits=httpx.Limits(max_connections=None)
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.monotonic()

        async def one(i: int, at: float, cls: str, prompt: str) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            rec = RequestRecord(
                id=f"demo-{i}",
                slo_class=cls,
                tpot_slo_ms=0.0,
                arrival_s=time.monotonic() - t0,
                prompt_tokens=0,
                max_tokens=round(MAX_TOKENS[cls] * args.max_tokens_scale),
            )
            status.sent += 1
            await _stream_one(client, model, prompt, rec, chunks, t0)
            status.finish(rec)
            return rec

        records = await asyncio.gather(*(one(i, *a) for i, a in enumerate(arrivals)))
    status.close()
    return list(records), chunks


async def _stream_one(client, model, prompt, rec: RequestRecord, chunks, t0) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": rec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "slo_class": rec.slo_class,
        "request_id": rec.id,
    }
    n_chunks = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.finish_reason = "rejected" if resp.status_code == 429 else "error"
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                frame = json.loads(line[5:])
                now = time.monotonic() - t0
                if slo := frame.get("slo"):
                    rec.tpot_slo_ms = slo.get("tpot_slo_ms") or rec.tpot_slo_ms
                    rec.ttft_slo_ms = slo.get("ttft_slo_ms") or rec.ttft_slo_ms
                    rec.best_effort = bool(slo.get("best_effort"))
                if usage := frame.get("usage"):
                    rec.num_tokens = int(usage["completion_tokens"])
                    rec.prompt_tokens = int(usage["prompt_tokens"])
                for choice in frame.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        n_chunks += 1  # the gateway sends one chunk per verification step
                        rec.first_token_s = rec.first_token_s or now
                        rec.last_token_s = now
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as exc:
        rec.finish_reason, rec.error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        rec.finish_s = time.monotonic() - t0
        chunks[rec.id] = n_chunks


class _Status:
    """One live status line on stderr (no dependency on a terminal library)."""

    def __init__(self, total: int) -> None:
        self.total, self.sent, self.done, self.ok = total, 0, 0, 0
        self.tty = sys.stderr.isatty()

    def finish(self, rec: RequestRecord) -> None:
        self.done += 1
        self.ok += rec.attained
        line = (
            f"requests {self.done}/{self.total} done, {self.sent - self.done} in flight, "
            f"SLO attained {self.ok}/{self.done}"
        )
        if self.tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        elif self.done % 10 == 0 or self.done == self.total:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _attained(g: dict) -> str:
    if g["slo_attainment"] is None:
        return "-"
    both, ttft, tpot = (
        100 * g[k] for k in ("slo_attainment", "ttft_attainment", "tpot_attainment")
    )
    return f"{both:.0f}% ({ttft:.0f}/{tpot:.0f})"


def format_table(summary: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.0f}"

    rows = [
        (
            "class",
            "SLO ms",
            "TTFT SLO ms",
            "reqs",
            "TTFT p50/p90 ms",
            "TPOT p50/p90 ms",
            "attained (TTFT/TPOT)",
            "goodput tok/s",
            "tokens/step",
        )
    ]
    for name, g in summary["per_class"].items():
        rows.append(
            (
                name,
                ms(g.get("tpot_slo_ms")),
                ms(g.get("ttft_slo_ms")),
                str(g["requests"]),
                f"{ms(g['ttft_p50_ms'])}/{ms(g['ttft_p90_ms'])}",
                f"{ms(g['tpot_p50_ms'])}/{ms(g['tpot_p90_ms'])}",
                _attained(g),
                f"{g['goodput']:.1f}",
                "-" if g.get("mean_accepted") is None else f"{g['mean_accepted']:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


CLASS_COLORS = {"coding": "tab:red", "chat": "tab:blue", "summarize": "tab:green"}
# Tick values of the log TPOT axis, in plain milliseconds.
_NICE_MS = [1, 2, 3, 5, 10, 20, 30, 50, 100, 200, 300, 500, 1000, 2000, 5000]


def _plot(records: list[RequestRecord], path: Path, rps: float | None = None) -> Path:
    """Two panels, readable whatever the SLOs' spread: each class's TPOT on a log axis
    with its own SLO drawn over its column only (one long SLO line no longer squashes
    the rest), and every request's TPOT / SLO over the run against one line at 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    done = [r for r in records if r.tpot_ms is not None and r.tpot_slo_ms]
    classes = sorted({r.slo_class for r in done}, key=lambda c: (_slo_of(done, c), c))
    fig, (by_class, ratio) = plt.subplots(
        1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.6]}
    )
    rng = np.random.default_rng(0)  # jitter only: the same picture every time
    for i, cls in enumerate(classes):
        rs = [r for r in done if r.slo_class == cls]
        color = CLASS_COLORS.get(cls, f"C{i}")
        tpot = np.array([r.tpot_ms for r in rs])
        x = i + rng.uniform(-0.18, 0.18, len(rs))
        by_class.scatter(x, tpot, s=14, color=color, alpha=0.7)
        by_class.hlines(np.median(tpot), i - 0.3, i + 0.3, color=color, linewidth=2.5)
        slo = _slo_of(done, cls)
        by_class.hlines(slo, i - 0.4, i + 0.4, color=color, linestyle="--", linewidth=1.2)
        by_class.annotate(
            f"SLO {slo:.0f} ms",
            (i, slo),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=8,
            color=color,
        )
        ratio.scatter(
            [r.arrival_s for r in rs],
            tpot / np.array([r.tpot_slo_ms for r in rs]),
            s=14,
            color=color,
            alpha=0.8,
            label=f"{cls} (SLO {slo:.0f} ms, p50 TPOT {np.median(tpot):.0f} ms)",
        )
    by_class.set_yscale("log")
    by_class.yaxis.set_major_locator(FixedLocator(_NICE_MS))
    by_class.yaxis.set_major_formatter(ScalarFormatter())
    by_class.yaxis.set_minor_formatter(NullFormatter())
    by_class.set_xticks(range(len(classes)), classes)
    by_class.set_xlim(-0.6, len(classes) - 0.4)
    by_class.set_ylabel("TPOT (ms per token, log scale)")
    by_class.set_title("TPOT per class: bar = median, dashed = SLO", fontsize=10)
    ratio.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ratio.annotate(
        "SLO",
        (1.0, 1.0),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 3),
        textcoords="offset points",
        ha="right",
        fontsize=8,
    )
    # Room above the line for the legend.
    top = max([1.5] + [t / r.tpot_slo_ms * 1.1 for r in done if (t := r.tpot_ms) is not None])
    ratio.set_ylim(0, top)
    ratio.set_xlabel("arrival time (s)")
    ratio.set_ylabel("TPOT / SLO (below 1: attained)")
    ratio.set_title("every request against its own SLO", fontsize=10)
    if classes:
        ratio.legend(fontsize=8, loc="upper left")
    load = f" at {rps:g} req/s" if rps else ""
    fig.suptitle(f"adaserve demo{load}: {_observed(done, classes)}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _observed(done: list[RequestRecord], classes: list[str]) -> str:
    """The title states what this run shows, not what it is meant to show: each class's
    median TPOT against its SLO (tightest SLO first), and whether the medians came out
    in the SLOs' order."""
    medians = {
        c: float(np.median([t for r in done if r.slo_class == c and (t := r.tpot_ms) is not None]))
        for c in classes
    }
    parts = [f"{c} p50 {medians[c]:.0f} ms (SLO {_slo_of(done, c):.0f})" for c in classes]
    if len(classes) < 2:
        return "; ".join(parts) or "no finished request"
    ordered = all(medians[a] <= medians[b] for a, b in itertools.pairwise(classes))
    verdict = "medians in SLO order" if ordered else "medians NOT in SLO order"
    return f"{'; '.join(parts)} - {verdict}"


def _slo_of(records: list[RequestRecord], cls: str) -> float:
    """The class's SLO as the server resolved it (the same for all its requests)."""
    return max(r.tpot_slo_ms for r in records if r.slo_class == cls)
