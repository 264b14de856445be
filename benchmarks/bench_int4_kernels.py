"""adaserve's int4 layers against PyTorch's own int4 weight-only CPU op, side by side.

Issue 32 asks to measure the candidates for int4 / int8 weight-only kernels before
choosing. `model.quantization: int4` runs Q4_1 blocks on adaserve's packed kernel
(`QuantLinear`, int8 or float32 activations); the alternative a PyTorch user reaches
for is `torch.ops.aten._weight_int4pack_mm_for_cpu` (asymmetric int4 per group, the op
torchao's CPU int4 layout calls; torchao itself is not installed here). Both take
group 32, on SmolLM2-135M's layer shapes (gate_up 576x3072, down 1536x576, LM head
576x49152), 1 / 5 / 16 token rows, beside float32 (adaserve's packed kernel and MKL).
Milliseconds per call, median of 7 timings; weights stay cache-hot between calls, so
this compares kernels, not memory systems.

    .venv/bin/python -m benchmarks.bench_int4_kernels [--threads 2] [--reps 100]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from adaserve.model.cpu_gemm import PackedLinear, QuantLinear
from adaserve.model.stored import Q4_1, quantize_blocks

GROUP = 32
SHAPES = [(576, 3072), (1536, 576), (576, 49152)]  # (in, out)
ROWS = [1, 5, 16]


def int4pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] as PyTorch's int4 CPU layout: q in 0..15 per group of 32 with
    w ~= (q - 8) * scale + zero (the op's convention), packed by its own converter."""
    out, k = w.shape
    wg = w.view(out, k // GROUP, GROUP)
    hi, lo = wg.amax(-1), wg.amin(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(out, k), 1)
    scales_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()
    return packed, scales_zeros


def timed(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int) -> float:
    for _ in range(3):
        f(x)
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            f(x)
        runs.append((time.perf_counter() - t) / reps * 1e3)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"ms per call, {args.threads} threads, median of 7 x {args.reps}")
    for k, n in SHAPES:
        w = torch.randn(n, k) * 0.05
        raw = quantize_blocks(w, Q4_1)
        ours = {a: QuantLinear(raw, Q4_1, k, activations=a) for a in ("int8", "float32")}
        packed, sz = int4pack(w)
        sz_bf16 = sz.to(torch.bfloat16)
        fp32 = PackedLinear(w.t().contiguous(), None)
        wt = w.t().contiguous()
        for rows in ROWS:
            x = torch.randn(rows, k)
            reps = max(1, args.reps // rows)
            cols = {
                "adaserve Q4_1 int8-act": timed(ours["int8"], x, reps),
                "adaserve Q4_1 fp32-act": timed(ours["float32"], x, reps),
                "torch int4pack bf16-act": timed(
                    lambda a, pk=packed, s=sz_bf16: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        a, pk, GROUP, s
                    ),
                    x.to(torch.bfloat16),
                    reps,
                ),
                "adaserve fp32": timed(fp32, x, reps),
                "MKL fp32": timed(lambda a, w_t=wt: a @ w_t, x, reps),
            }
            print(f"{k}x{n} rows {rows:2d}: " + ", ".join(f"{c} {v:.3f}" for c, v in cols.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
