"""Plain greedy decoding, single stream: the adaserve runner vs Hugging Face `generate`
on the same model, prompt and thread count (DESIGN.md section 5 protocol: 42-token
prompt, 128 new tokens, median of 3). Both produce the same tokens; that is checked.

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

from adaserve.model.loader import load_runner, resolve_model
from adaserve.model.runner import ModelRunner, SeqInput


def runner_decode(runner: ModelRunner, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Returns (tokens, seconds) for prefill + n-1 decode steps (n tokens in all)."""
    t0 = time.perf_counter()
    runner.add_sequence("bench")
    logits = runner.forward([SeqInput.chain("bench", prompt)], last_only=True)
    runner.commit("bench", range(len(prompt)))
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        logits = runner.forward([SeqInput.chain("bench", out[-1:])])
        runner.commit("bench", [0])
        out.append(int(logits[0].argmax()))
    dt = time.perf_counter() - t0
    runner.free("bench")
    return out, dt


def hf_decode(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return gen[0, len(prompt) :].tolist(), time.perf_counter() - t0  # .tolist() syncs


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
        ours = [runner_decode(runner, prompt, n) for _ in range(args.repeats)]
        row = {"threads": threads, "runner_tok_s": n / statistics.median(t for _, t in ours)}
        if hf is not None:
            hf_decode(hf, prompt, 8)
            theirs = [hf_decode(hf, prompt, n) for _ in range(args.repeats)]
            row["hf_generate_tok_s"] = n / statistics.median(t for _, t in theirs)
            row["same_tokens"] = ours[0][0] == theirs[0][0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'threads':>7} {'runner tok/s':>13} {'HF generate tok/s':>18}")
    for r in rows:
        hf_s = f"{r['hf_generate_tok_s']:.1f}" if "hf_generate_tok_s" in r else "-"
        print(f"{r['threads']:>7} {r['runner_tok_s']:>13.1f} {hf_s:>18}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": str(path),
        "prompt_len": args.prompt_len,
        "new_tokens": n,
        "repeats": args.repeats,
        "load_avg": os.getloadavg(),
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
