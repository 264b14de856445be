"""Target generation speed of `adaserve distill` (the teacher's batched decode with top-k
labels) on a random-weight SmolLM2-135M shape, with a profiler table of one short run.

    python benchmarks/gpu/bench_distill_gen.py [--batch 768] [--new 64] [--layers 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not

from adaserve.distill.generate import generate_batch  # noqa: E402
from adaserve.distill.llama import LlamaModel, LlamaShape  # noqa: E402

SMOLLM2 = LlamaShape(
    vocab=49152,
    hidden=576,
    intermediate=1536,
    heads=9,
    kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    eps=1e-5,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=768)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = LlamaModel(SMOLLM2, args.layers).to(dev).eval().requires_grad_(False)
    if dev.type == "cuda":
        model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(40, 300, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(0, SMOLLM2.vocab, (n,), generator=g).tolist() for n in lens]
    never = [SMOLLM2.vocab - 1]  # random weights: keep every row going
    tokens = {}
    for static in (False, True):
        generate_batch(model, prompts[:8], 4, never, static=static)  # warm-up
        times = {}
        for new in (1, args.new):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = generate_batch(model, prompts, new, never, static=static)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[new] = time.perf_counter() - t0
        tokens[static] = [o.tokens for o in outs]
        step = (times[args.new] - times[1]) / (args.new - 1)
        mode = "static" + (" (CUDA graph)" if dev.type == "cuda" else "") if static else "eager"
        print(
            f"{mode:>20}: batch {args.batch}, {args.layers} layers: prefill+1 {times[1]:.3f} s, "
            f"decode step {step * 1e3:.1f} ms, {args.batch / step:.0f} tokens/s",
            flush=True,
        )
    same = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True))
    print(f"rows identical eager vs static: {same}/{len(prompts)}", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            generate_batch(model, prompts, 9, never)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
        if dev.type == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
