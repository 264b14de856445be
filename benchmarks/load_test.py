"""Closed-loop load test of the all-process local deployment, with every stream checked.

    .venv/bin/python benchmarks/load_test.py                       # 200 clients, 60 s
    .venv/bin/python benchmarks/load_test.py --clients 24 --duration 10 --json out.json

Starts `adaserve up` (scheduler, drafter, verifier and gateway, each its own process)
on tiny random Llamas with a real character tokenizer (the drafter is a second random
model, so speculation accepts some tokens and rejects others), then runs N streaming
OpenAI clients, each sending greedy `/v1/completions` requests back to back for the
duration. Every stream is checked against the target's own greedy output for its
prompt (Hugging Face `generate`, computed before the run): the text must be the
reference text exactly, the usage must count every token, and `[DONE]` must end it.
So every token arrived exactly once and in order, or the run fails.

Reported: requests and tokens served, HTTP statuses (no 5xx allowed), failures by
kind, TTFT and TPOT p50/p99 as the clients saw them (TPOT per request as in DESIGN.md
5: (t_last - t_first) / (tokens - 1)), and every process's resident memory after the
warm-up, at the end and at its peak. Exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from services.common.server import new_event_loop  # noqa: E402
from tests._faults import greedy_reference_ignore_eos  # noqa: E402
from tests._serving import CHARS, make_served_model  # noqa: E402

DEPLOYMENT_CONFIG = """\
scheduler:
  budget: {budget}
engine:
  kv_memory_gb: 0.25
  max_running: {max_running}
  max_queue: {max_queue}
slo:
  baseline_tpot_ms: 20.0
# Every stream is checked under speculation: the model drafts for each request whatever
# `auto` would judge its draft steps worth on a busy host (it sometimes chose none).
speculation:
  default_method: model
"""


@dataclass
class Outcome:
    """One request as its client saw it."""

    status: int | None = None  # HTTP status; None: no response (connection error)
    failure: str | None = None  # why the stream does not count as correct
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0


@dataclass
class Report:
    clients: int
    duration_s: float
    max_tokens: int
    requests: int = 0
    correct: int = 0
    tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    failure_examples: list[str] = field(default_factory=list)
    ttft_ms: dict[str, float] = field(default_factory=dict)
    # The gateway's own view (from its histogram: the whole run, warm-up included),
    # to tell server time from time spent in the clients and the network.
    gateway_ttft_ms: dict[str, float] = field(default_factory=dict)
    gateway_tpot_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    memory_mb: dict[str, dict[str, float]] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.startswith("5"))

    @property
    def ok(self) -> bool:
        return self.requests > 0 and self.correct == self.requests and self.server_errors == 0


# ---- the deployment ---------------------------------------------------------------------


class Deployment:
    """`adaserve up` in its own process group; knows its children's pids."""

    def __init__(self, work: Path, target: Path, drafter: Path, args: argparse.Namespace):
        cfg = work / "deploy.yaml"
        cfg.write_text(
            DEPLOYMENT_CONFIG.format(
                budget=args.budget, max_running=args.max_running, max_queue=args.max_queue
            )
        )
        self.port = _free_port()
        self.log = work / "up.log"
        cmd = [sys.executable, "-m", "adaserve.cli", "up", "--port", str(self.port)]
        cmd += ["--target", str(target), "--drafter", str(drafter), "--config", str(cfg)]
        cmd += ["--log-dir", str(work / "logs"), "--verifier-units", str(args.units)]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=open(self.log, "wb"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.pids: dict[str, int] = {}
        self.engine_metrics: list[str] = []

    def wait_up(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            if "adaserve is up" in text:
                self.pids = {
                    m[0]: int(m[1]) for m in re.findall(r"started (\S+)\s+pid (\d+)", text)
                }
                self.pids["launcher"] = self.proc.pid
                self.engine_metrics = re.findall(r"(http://\S+/metrics)\s+\(verifier", text)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"adaserve up exited:\n{text[-3000:]}")
            time.sleep(0.5)
        raise TimeoutError("adaserve up did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT, as a terminal Ctrl-C: it stops its services
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def make_noisy_copy(model_dir: Path, out: Path, scale: float) -> Path:
    """The target with Gaussian noise (`scale` x each tensor's std) on every weight: a
    drafter that agrees with the target often but not always, so streams carry both
    multi-token acceptances and rejections."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    model.save_pretrained(out)
    for f in model_dir.iterdir():  # tokenizer and chat template
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class MemoryWatch:
    """Samples every process's RSS once a second. Growth over the second half of the
    run tells a leak from the first half's climb to the steady state (connection
    buffers, a full batch, allocator pools)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: dict[str, list[float]] = {name: [] for name in pids}

    def sample(self) -> None:
        for name, pid in self.pids.items():
            mb = rss_mb(pid)
            if mb is not None:
                self.samples[name].append(mb)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            await asyncio.sleep(1.0)
        self.sample()

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, xs in self.samples.items():
            if not xs:
                continue
            mid = xs[len(xs) // 2]
            out[name] = {
                "start": round(xs[0], 1),
                "mid": round(mid, 1),
                "end": round(xs[-1], 1),
                "peak": round(max(xs), 1),
                "growth": round(xs[-1] - xs[0], 1),
                "growth_second_half": round(xs[-1] - mid, 1),
            }
        return out


# ---- clients ----------------------------------------------------------------------------


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    printable = len(CHARS)  # token ids of printable characters
    return [rng.integers(0, printable, rng.integers(4, 24)).tolist() for _ in range(n)]


async def one_request(
    http: httpx.AsyncClient, url: str, prompt: list[int], ref_text: str, max_tokens: int
) -> Outcome:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = Outcome()
    t0 = time.monotonic()
    t_first = t_last = None
    parts: list[str] = []
    done = False
    usage = None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:120]
                out.failure = f"http {r.status_code}: {detail}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    out.failure = f"error frame: {obj['error'].get('message', '')[:80]}"
                for choice in obj.get("choices") or []:
                    now = time.monotonic()
                    t_first = now if t_first is None else t_first
                    t_last = now
                    parts.append(choice.get("text", ""))
                if obj.get("usage"):
                    usage = obj["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.failure = f"transport: {type(exc).__name__}"
        return out
    text = "".join(parts)
    out.tokens = usage or 0
    if out.failure is None:
        if not done:
            out.failure = "no [DONE]"
        elif usage != max_tokens:
            out.failure = f"usage {usage} != {max_tokens}"
        elif text != ref_text:
            at = next(
                (i for i, (a, b) in enumerate(zip(text, ref_text, strict=False)) if a != b), None
            )
            out.failure = f"text differs from the reference at {at}: {text!r} != {ref_text!r}"
    if t_first is not None:
        out.ttft_s = t_first - t0
        if t_last is not None and out.tokens > 1:
            out.tpot_s = (t_last - t_first) / (out.tokens - 1)
    return out


async def drive(
    url: str,
    prompts: list[list[int]],
    refs: list[str],
    clients: int,
    duration_s: float,
    max_tokens: int,
    pids: dict[str, int],
) -> tuple[list[Outcome], MemoryWatch]:
    timeout = httpx.Timeout(120.0, connect=30.0)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=timeout) as http:
        # Warm-up: each prompt once (and checked), before the memory baseline.
        warm = await asyncio.gather(
            *(one_request(http, url, p, r, max_tokens) for p, r in zip(prompts, refs, strict=True))
        )
    bad = [o.failure for o in warm if o.failure]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[:3]}")
    watch = MemoryWatch(pids)
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch.run(stop))
    end = time.monotonic() + duration_s

    async def client(k: int) -> None:
        # One connection per client, as separate users have: one pool shared by
        # hundreds of streams queues requests inside the client library for seconds.
        async with httpx.AsyncClient(timeout=timeout) as http:
            n = 0
            while time.monotonic() < end:
                i = (k * 7 + n) % len(prompts)
                out = await one_request(http, url, prompts[i], refs[i], max_tokens)
                outcomes.append(out)
                n += 1
                if out.status == 429:
                    await asyncio.sleep(1.0)  # honour Retry-After, as a client should

    await asyncio.gather(*(client(k) for k in range(clients)))
    stop.set()
    await watcher
    return outcomes, watch


def histogram_quantiles(text: str, name: str, qs: tuple[float, ...]) -> dict[str, float]:
    """Quantiles (ms) of a Prometheus histogram, summed over its label sets and
    interpolated within buckets as PromQL's histogram_quantile does."""
    buckets: dict[float, float] = {}
    for le, count in re.findall(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
        buckets[float(le)] = buckets.get(float(le), 0.0) + float(count)
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return {}
    total, out = buckets[bounds[-1]], {}
    for q in qs:
        rank, lo, below = q * total, 0.0, 0.0
        for b in bounds:
            if buckets[b] >= rank:
                hi = lo if b == float("inf") else b
                frac = 0.0 if buckets[b] == below else (rank - below) / (buckets[b] - below)
                out[f"p{round(q * 100)}"] = round((lo + (hi - lo) * frac) * 1000.0, 1)
                break
            lo, below = b, buckets[b]
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * 1000.0
    return {
        "p50": round(float(np.percentile(a, 50)), 1),
        "p99": round(float(np.percentile(a, 99)), 1),
        "mean": round(float(a.mean()), 1),
    }


def engine_counters(urls: list[str]) -> dict[str, float]:
    """A few engine totals from the verifiers' Prometheus endpoints."""
    names = {
        "requests_finished": r"^adaserve_engine_requests_total\{[^}]*\} (\S+)",
        "spec_draft_tokens": r"^adaserve_spec_decode_num_draft_tokens_total (\S+)",
        "spec_accepted_tokens": r"^adaserve_spec_decode_num_accepted_tokens_total (\S+)",
        "fallbacks": r"^adaserve_fallbacks_total\{[^}]*\} (\S+)",
        "iterations": r"^adaserve_iterations_total (\S+)",
    }
    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        text = httpx.get(url, timeout=10).text
        for key, pattern in names.items():
            totals[key] += sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))
    return totals


def summarize(args: argparse.Namespace, outcomes: list[Outcome], watch: MemoryWatch) -> Report:
    rep = Report(args.clients, args.duration, args.max_tokens)
    rep.requests = len(outcomes)
    for o in outcomes:
        key = str(o.status) if o.status is not None else "none"
        rep.statuses[key] = rep.statuses.get(key, 0) + 1
        if o.failure is None:
            rep.correct += 1
            rep.tokens += o.tokens
        else:
            kind = o.failure.split(":")[0]
            rep.failures[kind] = rep.failures.get(kind, 0) + 1
            if len(rep.failure_examples) < 5:
                rep.failure_examples.append(o.failure)
    ok = [o for o in outcomes if o.failure is None]
    rep.ttft_ms = percentiles([o.ttft_s for o in ok if o.ttft_s is not None])
    rep.tpot_ms = percentiles([o.tpot_s for o in ok if o.tpot_s is not None])
    rep.tokens_per_s = round(rep.tokens / args.duration, 1)
    rep.memory_mb = watch.summary()
    return rep


def print_report(rep: Report) -> None:
    print(
        f"\n{rep.clients} clients x {rep.duration_s:.0f} s, max_tokens {rep.max_tokens}: "
        f"{rep.requests} requests, {rep.correct} correct, {rep.tokens} tokens "
        f"({rep.tokens_per_s} tok/s)"
    )
    print(f"statuses {rep.statuses}; 5xx {rep.server_errors}; failures {rep.failures or 0}")
    for example in rep.failure_examples:
        print(f"  e.g. {example}")
    print(f"TTFT ms {rep.ttft_ms} (at the gateway: {rep.gateway_ttft_ms})")
    print(f"TPOT ms {rep.tpot_ms} (at the gateway: {rep.gateway_tpot_ms})")
    print("memory MB (after warm-up -> half-time -> end; peak; growth, of it second half):")
    for name, m in rep.memory_mb.items():
        print(
            f"  {name:<12} {m['start']:7.1f} -> {m['mid']:7.1f} -> {m['end']:7.1f}  "
            f"peak {m['peak']:7.1f}  growth {m['growth']:+.1f}, {m['growth_second_half']:+.1f}"
        )
    if rep.engine:
        print(f"engine {rep.engine}")
    print("PASS" if rep.ok else "FAIL")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    ap.add_argument("--units", type=int, default=1, help="verifier units")
    ap.add_argument(
        "--drafter-noise", type=float, default=0.1, help="drafter = target + this much noise"
    )
    ap.add_argument(
        "--budget",
        type=int,
        default=16,
        help="verifier tokens per iteration (every running request's root takes one: "
        "speculation needs more than the batch size)",
    )
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--work-dir", help="models and logs (default: a new temporary directory)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="adaserve-load-"))
    work.mkdir(parents=True, exist_ok=True)
    target = make_served_model(work / "target", seed=0)
    drafter = make_noisy_copy(target, work / "drafter", args.drafter_noise)
    deployment = Deployment(work, target, drafter, args)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
        prompts = make_prompts(args.prompts)
        refs = [
            tokenizer.decode(
                greedy_reference_ignore_eos(target, p, args.max_tokens), skip_special_tokens=True
            )
            for p in prompts
        ]
        deployment.wait_up()
        print(f"deployment up at {deployment.url}: {deployment.pids}; logs in {work}", flush=True)
        # uvloop: with hundreds of streams the clients' own parsing is a real share of
        # a small machine's CPU, and a lagging client loop inflates what it measures.
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            outcomes, watch = runner.run(
                drive(
                    deployment.url,
                    prompts,
                    refs,
                    args.clients,
                    args.duration,
                    args.max_tokens,
                    deployment.pids,
                )
            )
        rep = summarize(args, outcomes, watch)
        rep.engine = engine_counters(deployment.engine_metrics)
        gw = httpx.get(f"{deployment.url}/metrics", timeout=10).text
        qs = (0.5, 0.99)
        rep.gateway_ttft_ms = histogram_quantiles(
            gw, "adaserve_gateway_time_to_first_token_seconds", qs
        )
        rep.gateway_tpot_ms = histogram_quantiles(
            gw, "adaserve_gateway_time_per_output_token_seconds", qs
        )
    finally:
        deployment.stop()
    print_report(rep)
    if args.json:
        Path(args.json).write_text(
            json.dumps(asdict(rep) | {"server_errors": rep.server_errors, "ok": rep.ok}, indent=2)
        )
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
