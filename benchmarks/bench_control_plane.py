"""Per-iteration control-plane overhead of the gRPC deployment against all-in-one.

    .venv/bin/python benchmarks/bench_control_plane.py --out out/bench_control_plane

One Engine, stepped synchronously in this process over the embedded SmolLM2 target,
for each n (concurrent requests) in two wirings, interleaved per n so both see the
same machine load:
- all-in-one: in-process BeamDrafter + LocalScheduler;
- grpc: GrpcDrafter + GrpcScheduler against `adaserve drafter` / `adaserve scheduler`
  in their own processes on loopback (same drafter model, same settings file).
Depth and width are fixed (adaptive policy `fixed`) so both wirings do the same work.

Every Plan / Speculate / Select call is timed where the engine makes it. Per iteration:
- selection: the Select call (in-process: the selection itself; gRPC: the whole call);
- Speculate RPC overhead: client-observed call minus the server's own compute time
  (SpeculateResponse.timing.compute_us), i.e. serialization both ways + transport;
- added: what gRPC costs over all-in-one in the same iteration =
  (Plan call - local plan) + (Select call - local selection of the same inputs, timed
  right after the call) + Speculate RPC overhead.
Goal (issue 5): added <= 2 ms per iteration at n=32. Prints a table and writes
results.json and control_plane.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from adaserve.config import Settings, load_settings  # noqa: E402
from adaserve.drafter import Drafter  # noqa: E402
from adaserve.engine import Engine  # noqa: E402
from adaserve.request import GenerationRequest, SamplingParams  # noqa: E402
from adaserve.runner_target import RunnerTarget  # noqa: E402
from adaserve.scheduler import LocalScheduler, Scheduler  # noqa: E402
from benchmarks.control_plane_probes import (  # noqa: E402
    Iteration,
    Probe,
    TimedDrafter,
    TimedScheduler,
    elapsed_ms,
)
from benchmarks.control_plane_report import goal_summary, plot, print_table  # noqa: E402
from services.verifier.wiring import build_drafter, build_scheduler  # noqa: E402

MODES = ("all-in-one", "grpc")
SLO_MS = (48.0, 50.0, 150.0)  # coding (1.2 x 40 ms baseline) / chat / summarize


def bench_settings(args: argparse.Namespace, drafter: str) -> Settings:
    return load_settings(
        args.config_path,
        model={"target": args.target, "drafter": drafter, "device": "cpu"},
        services={"drafter": None, "scheduler": None},
    )


def write_config(args: argparse.Namespace) -> Path:
    """One settings file for this process and both services, so they plan, select and
    size KV alike. Generous timeouts: a fallback would hide the call being measured."""
    import yaml

    cfg = {
        "scheduler": {
            "budget": args.budget,
            "remote_select": "always",  # the Select call is what is measured
            "adaptive": {
                "policy": "fixed",
                "fixed_depth": args.depth,
                "fixed_width": args.width,
                "d_max": args.depth,
                "w_max": args.width,
            },
        },
        "engine": {
            "kv_memory_gb": args.kv_memory_gb,
            "max_running": max(args.n),
            "speculation_timeout_ms": 60_000.0,
            "scheduler_timeout_ms": 60_000.0,
        },
    }
    path = args.out / "settings.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def resolve_drafter(args: argparse.Namespace) -> tuple[str, str]:
    """(model spec, description). The trained embedded drafter when it exists, else a
    random one with the target's exact shape but 2 layers (same vocab and tokenizer)."""
    from adaserve.model.embedded import DRAFTER_ASSET, resolve_model

    if args.drafter != "auto":
        return args.drafter, args.drafter
    if (DRAFTER_ASSET / "config.json").is_file():
        return "embedded", f"embedded drafter ({DRAFTER_ASSET.name})"
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    where = args.out / "random-drafter"
    if not (where / "config.json").is_file():
        config = AutoConfig.from_pretrained(resolve_model(args.target))
        config.num_hidden_layers = 2
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(where)
    return str(where), "random 2-layer drafter with the target's shape (no trained asset yet)"


def start_service(argv: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """An adaserve service on a free loopback port; returns once it listens (after its
    model loaded)."""
    cmd = [sys.executable, "-m", "adaserve.cli", *argv, "--host", "127.0.0.1", "--port", "0"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [*cmd, "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        )
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"{argv[0]} did not start ({line!r}); see {log}")
    return proc, line.split()[-1]


def run_one(
    target: RunnerTarget,
    drafter: Drafter,
    scheduler: Scheduler,
    settings: Settings,
    n: int,
    args: argparse.Namespace,
    tag: str,
) -> list[Iteration]:
    probe = Probe()
    local = LocalScheduler(settings.scheduler)
    engine = Engine(
        target, TimedDrafter(drafter, probe), TimedScheduler(scheduler, probe, local), settings
    )
    rng = np.random.default_rng([args.seed, n])
    steps = args.warmup + args.iters
    # ignore_eos and room for every step to accept a whole path: no request retires
    # mid-measurement, so every iteration has exactly n requests.
    sampling = SamplingParams(max_tokens=(steps + 2) * (args.depth + 1), ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        prompt = rng.integers(0, target.vocab_size, size=args.prompt_len).tolist()
        engine.submit(GenerationRequest(rid, tuple(prompt), sampling, SLO_MS[i % len(SLO_MS)]))
    out: list[Iteration] = []
    for k in range(steps):
        probe.current = Iteration()
        t0 = time.perf_counter_ns()
        engine.step()
        it = probe.current
        # the in-process shadow calls ran inside the step: not part of the iteration
        it.step_ms = elapsed_ms(t0) - it.plan_local_ms - it.select_local_ms
        if engine.stats().running != n:
            raise RuntimeError(f"{tag}: {engine.stats().running} running, expected {n}")
        if k >= args.warmup:  # the first steps carry prefill (target and drafter)
            out.append(it)
    for rid in ids:  # frees target KV; the next step flushes the drafter's Release
        engine.abort(rid)
    engine.step()
    return out


def summarize(mode: str, n: int, its: list[Iteration], load: float) -> dict:
    fields = ["plan", "spec", "select", "step", "control"]
    if mode == "grpc":
        fields += ["select_local", "select_rpc", "spec_rpc", "rpc", "added"]
        fields += ["client_cpu", "server_serde", "serde_cpu", "wait"]
    row: dict = {"mode": mode, "n": n, "iterations": len(its), "loadavg_1m": load}
    row["errors"] = int(sum(it.errors for it in its))
    for name in fields:
        v = np.array([_value(it, name) for it in its], dtype=np.float64)
        # p10: the least contended iterations, the closest to what an idle machine pays
        for q in (10, 50, 90):
            row[f"{name}_p{q}_ms"] = float(np.percentile(v, q))
    return row


def _value(it: Iteration, name: str) -> float:
    if name == "control":  # in-process Speculate has no RPC part: plan + select
        return it.plan_ms + it.select_ms + (it.spec_ms - it.spec_compute_ms)
    if name == "spec_rpc":
        return it.spec_ms - it.spec_compute_ms
    if name == "serde_cpu":  # the CPU work in the RPCs, apart from waiting
        return it.client_cpu_ms + it.server_serde_ms
    if name == "wait":  # transport + thread wake-ups + waiting for a CPU
        return it.rpc_ms - it.client_cpu_ms - it.server_serde_ms
    return getattr(it, f"{name}_ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_control_plane")
    ap.add_argument("--target", default="embedded", help="target model (default: SmolLM2)")
    ap.add_argument("--drafter", default="auto", help="drafter model; auto: see resolve_drafter")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--budget", type=int, default=64, help="verifier tokens per iteration")
    ap.add_argument("--iters", type=int, default=30, help="measured iterations per n and mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--kv-memory-gb", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.budget < max(args.n):
        ap.error("--budget must be >= max(--n): every root costs a slot")
    args.out.mkdir(parents=True, exist_ok=True)
    args.config_path = write_config(args)

    import torch

    from adaserve.engine_build import eos_token_ids
    from adaserve.model.loader import load_runner

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    drafter_spec, drafter_desc = resolve_drafter(args)
    settings = bench_settings(args, drafter_spec)
    print(f"target {args.target}, drafter: {drafter_desc}", flush=True)

    cfg = ["--config", str(args.config_path)]
    sched_proc, sched_addr = start_service(["scheduler", *cfg], args.out / "scheduler.log")
    draft_proc, draft_addr = start_service(
        [
            "drafter",
            "--model",
            drafter_spec,
            "--device",
            "cpu",
            "--threads",
            str(args.threads),
            *cfg,
        ],
        args.out / "drafter.log",
    )
    rows: list[dict] = []
    try:
        runner = load_runner(
            settings.model.target,
            device="cpu",
            kv_memory_gb=settings.engine.kv_memory_gb,
            kv_block_size=settings.engine.kv_block_size,
        )
        target = RunnerTarget(runner, eos_token_ids(None, runner))
        grpc_settings = settings.model_copy(
            update={
                "services": settings.services.model_copy(
                    update={"drafter": draft_addr, "scheduler": sched_addr}
                )
            }
        )
        wirings = {
            "all-in-one": (build_drafter(settings), build_scheduler(settings), settings),
            "grpc": (build_drafter(grpc_settings), build_scheduler(grpc_settings), grpc_settings),
        }
        for n in args.n:
            for mode in MODES:  # interleaved: both wirings see the same load
                drafter, scheduler, s = wirings[mode]
                load = os.getloadavg()[0]
                t0 = time.monotonic()
                its = run_one(target, drafter, scheduler, s, n, args, f"{mode}-n{n}")
                row = summarize(mode, n, its, load)
                rows.append(row)
                print(
                    f"n={n:3d} {mode:10s} control p50 {row['control_p50_ms']:7.3f} ms, "
                    f"iteration p50 {row['step_p50_ms']:8.1f} ms, load {load:.1f} "
                    f"({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
    finally:
        for proc in (draft_proc, sched_proc):
            proc.terminate()
            proc.wait(timeout=30)

    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    meta.update(
        drafter_description=drafter_desc,
        cpus=os.cpu_count(),
        nice=os.nice(0),
        loadavg_before=list(load_before),
        loadavg_after=list(os.getloadavg()),
    )
    summary = goal_summary(rows)
    (args.out / "results.json").write_text(
        json.dumps({"config": meta, "rows": rows, "summary": summary}, indent=2)
    )
    print_table(rows, meta, summary)
    plot(rows, args.out / "control_plane.png", meta)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'control_plane.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
