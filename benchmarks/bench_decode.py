"""Plain greedy decoding, single stream: the adaserve runner vs Hugging Face `generate`
on the same model, prompt and thread count (DESIGN.md section 5 protocol: 42-token
prompt, 128 new tokens, median of 3, prefill included). Both produce the same tokens;
that is checked. Runs alternate (ours, theirs, ours, ...) so load drifts hit both.

Besides wall-clock tokens/s it reports tokens per CPU-second of this process: on a
shared, oversubscribed machine that is the fairer single-thread comparison (it does
not count time spent waiting for a core; with several threads it counts spinning).

    .venv/bin/python benchmarks/bench_decode.py [--model embedded] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from adaserve.model.embedded import resolve_model
from adaserve.model.loader import load_runner
from adaserve.model.runner import ModelRunner, SeqInput


def runner_decode(runner: ModelRunner, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """Returns (tokens, wall s, cpu s) for prefill + n-1 decode steps (n tokens)."""
    t0, c0 = time.perf_counter(), time.process_time()
    runner.add_sequence("bench")
    logits = runner.forward([SeqInput.chain("bench", prompt)], last_only=True)
    runner.commit("bench", range(len(prompt)))
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        logits = runner.forward([SeqInput.chain("bench", out[-1:])])
        runner.commit("bench", [0])
        out.append(int(logits[0].argmax()))
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    runner.free("bench")
    return out, dt, dc


def hf_decode(model, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    ids = torch.tensor([prompt], device=model.device)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    out = gen[0, len(prompt) :].tolist()  # .tolist() syncs
    return out, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--prompt-len", type=int, default=42)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode.json"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    runner = load_runner(path, args.device, args.dtype, kv_memory_gb=0.25)
    hf = None
    if not args.skip_hf:
        hf = (
            AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=runner.dtype)
            .to(runner.device)
            .eval()
        )
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, runner.vocab_size, args.prompt_len).tolist()
    n = args.new_tokens
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        runner_decode(runner, prompt, 8)  # warm-up
        if hf is not None:
            hf_decode(hf, prompt, 8)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(runner_decode(runner, prompt, n))
            if hf is not None:
                theirs.append(hf_decode(hf, prompt, n))
        row = {"threads": threads, **_rates("runner", ours, n)}
        if hf is not None:
            row.update(_rates("hf_generate", theirs, n))
            row["same_tokens"] = ours[0][0] == theirs[0][0]
        row["load_avg"] = os.getloadavg()[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{'threads':>7} {'runner tok/s':>13} {'(tok/cpu-s)':>11} {'HF tok/s':>9} {'(tok/cpu-s)':>11}"
    )
    for r in rows:
        hf_s = (
            f"{r['hf_generate_tok_s']:>9.1f} {r['hf_generate_tok_cpu_s']:>11.1f}"
            if "hf_generate_tok_s" in r
            else f"{'-':>9} {'-':>11}"
        )
        print(f"{r['threads']:>7} {r['runner_tok_s']:>13.1f} {r['runner_tok_cpu_s']:>11.1f} {hf_s}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": str(path),
        "device": str(runner.device),
        "dtype": str(runner.dtype),
        "prompt_len": args.prompt_len,
        "new_tokens": n,
        "repeats": args.repeats,
        "load_avg": os.getloadavg(),
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def _rates(name: str, runs: list[tuple[list[int], float, float]], n: int) -> dict[str, float]:
    return {
        f"{name}_tok_s": n / statistics.median(r[1] for r in runs),
        f"{name}_tok_cpu_s": n / statistics.median(r[2] for r in runs),
    }


if __name__ == "__main__":
    main()
