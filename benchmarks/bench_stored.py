"""Stored GGUF blocks vs float32 on the CPU (`model.quantization: stored | none`,
adaserve/model/stored.py), side by side in one process; stored with float32 or int8
activations (`model.stored_activations`: "stored" / "stored-i8" below).

1. Forward latency of the embedded target after a committed prefix: a one-token decode
   step and a verify step of 5, 8 and 16 tree tokens (bench_verify.py's beam tree),
   for none / stored / stored-i8, each on the AVX-512 and the AVX2 build of the kernel
   where the CPU runs both (the linear layers' calls switched to that build; norms and
   attention stay on the widest). Round-robin over configurations, median of --reps.
2. End to end through the engine (configs/embedded-cpu.yaml, shipped int8 drafter),
   one request of --tokens greedy tokens at a time, none / stored / stored-i8 in turn:
   tokens per second (median of --e2e-reps), and that none and stored emit the same
   tokens (stored-i8: how many of the first tokens agree with none's).

    .venv/bin/python benchmarks/bench_stored.py [--reps 15] [--tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from adaserve.model import cpu_gemm, cpu_layers
from adaserve.model.loader import load_runner
from adaserve.model.runner import ModelRunner, SeqInput
from benchmarks.bench_verify import beam_tree, time_forward

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "embedded-cpu.yaml"
SIZES = [1, 5, 8, 16, 64]  # 64: a prefill chunk
# name -> (model.quantization, model.stored_activations)
CONFIGS = {
    "none": ("none", "int8"),
    "stored": ("stored", "float32"),
    "stored-i8": ("stored", "int8"),
}


def use_isa(runner: ModelRunner, isa: str) -> None:
    """Point every packed linear layer of `runner`, and its fused decoder layers
    (cpu_layers.py), at the `isa` build of the kernel."""
    lib = cpu_gemm.kernel(isa)
    if runner.model.cpu_layers is not None:
        runner.model.cpu_layers = cpu_layers.fuse(runner.model, isa)
    for m in runner.model.modules():
        if isinstance(m, cpu_gemm.QuantLinear):
            i8 = m.activations == "int8"
            m._call = lib.adaserve_quant_i8_linear if i8 else lib.adaserve_quant_linear
        elif isinstance(m, cpu_gemm.PackedLinear):
            m._call = lib.adaserve_skinny_linear


def forward_latency(reps: int, prefix_len: int, clock) -> None:
    isas = cpu_gemm.supported_isas()
    runners: dict[str, ModelRunner] = {}
    for name, (quant, acts) in CONFIGS.items():
        for isa in isas:
            r = load_runner(
                "embedded",
                "cpu",
                kv_memory_gb=0.25,
                quantization=quant,
                stored_activations=acts,
            )
            assert isinstance(r, ModelRunner)
            use_isa(r, isa)
            runners[f"{name}/{isa}"] = r
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 49152, prefix_len)
    trees = {n: (rng.integers(100, 49152, n).astype(np.int32), beam_tree(n)) for n in SIZES}
    for r in runners.values():
        r.add_sequence("bench")
        r.forward([SeqInput.chain("bench", prefix)], last_only=True)
        r.commit("bench", range(prefix_len))
        for n in SIZES:
            time_forward(r, "bench", *trees[n], lambda: None, clock)
    samples = {k: {n: [] for n in SIZES} for k in runners}
    for _ in range(reps):
        for n in SIZES:
            for k, r in runners.items():
                dt = time_forward(r, "bench", *trees[n], lambda: None, clock)
                samples[k][n].append(dt * 1e3)
    print(
        f"forward ms after a {prefix_len}-token prefix, median of {reps} ({torch.get_num_threads()} threads)"
    )
    print(f"{'config':<24}" + "".join(f"{f'{n} tok':>10}" for n in SIZES))
    meds = {k: {n: statistics.median(v) for n, v in s.items()} for k, s in samples.items()}
    for k, m in meds.items():
        print(f"{k:<24}" + "".join(f"{m[n]:>10.2f}" for n in SIZES))
    for isa in isas:
        for a, b in [("none", "stored"), ("none", "stored-i8"), ("stored", "stored-i8")]:
            ratio = [meds[f"{a}/{isa}"][n] / meds[f"{b}/{isa}"][n] for n in SIZES]
            print(f"{f'{a}/{b} {isa}':<24}" + "".join(f"{x:>9.2f}x" for x in ratio))


def engine_tokens_per_s(tokens: int, reps: int) -> None:
    from adaserve.config import load_settings
    from adaserve.engine_build import build_engine
    from adaserve.request import GenerationRequest, SamplingParams

    engines = {}
    for name, (quant, acts) in CONFIGS.items():
        model = {"quantization": quant, "stored_activations": acts}
        settings = load_settings(CONFIG, slo={"baseline_tpot_ms": 50.0}, model=model)
        engines[name] = build_engine(settings)
    tok = engines["none"].tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}],
        add_generation_prompt=True,
    )
    if not isinstance(prompt, list):
        prompt = list(prompt["input_ids"])
    rates: dict[str, list[float]] = {q: [] for q in engines}
    outputs: dict[str, list[int]] = {}
    for rep in range(reps + 1):  # the first round warms up
        for quant, engine in engines.items():
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            stream = engine.submit(
                GenerationRequest(f"{quant}-{rep}", tuple(prompt), params, tpot_slo_ms=1e4)
            )
            out: list[int] = []
            t0 = time.perf_counter()
            while engine.has_work():
                engine.step()
                while (d := stream.get(timeout=0)) is not None:
                    out.extend(d.token_ids)
            dt = time.perf_counter() - t0
            outputs[quant] = out
            if rep:
                rates[quant].append(len(out) / dt)
    print(f"\nengine, 1 request, {tokens} tokens (prefill included), median of {reps}:")
    for quant, r in rates.items():
        print(
            f"  {quant:<7} {statistics.median(r):7.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in r)})"
        )
    for name in ("stored", "stored-i8"):
        ratio = statistics.median(rates[name]) / statistics.median(rates["none"])
        print(f"  {name}/none {ratio:.2f}x")
    print(f"  none and stored: same tokens: {outputs['none'] == outputs['stored']}")
    same = next(
        (
            i
            for i, (a, b) in enumerate(zip(outputs["none"], outputs["stored-i8"], strict=False))
            if a != b
        ),
        None,
    )
    print(f"  stored-i8: first token differing from none's: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--e2e-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-e2e", action="store_true")
    # cpu: this process's CPU time, the fairer measure on a shared, oversubscribed
    # machine with one thread (it leaves out waiting for a core; bench_verify.py's).
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"clock: {args.clock}")
    forward_latency(args.reps, args.prefix, clock)
    if not args.skip_e2e:
        engine_tokens_per_s(args.tokens, args.e2e_reps)


if __name__ == "__main__":
    main()
