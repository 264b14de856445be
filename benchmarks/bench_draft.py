"""Draft step latency vs n*w (frontier tokens per step), through BeamDrafter.

    .venv/bin/python benchmarks/bench_draft.py --out out/bench_draft
    .venv/bin/python benchmarks/bench_draft.py --drafters smol-shape --device cuda

Drafters:
- `embedded`: the SmolLM2-135M target standing in as its own drafter (the
  head-dominated cost the issue worries about: 49152 x 576 LM head);
- `tiny`: a random 2-layer, hidden-64 Llama with the same 49152 vocabulary;
- `smol-shape`: random weights with SmolLM2-135M's exact shape, for machines without
  the embedded checkpoint (a GPU box): same cost, no download.

For every (n requests, w) with n*w <= --max-tokens, it times `speculate` at depth 1
(step 1 only: one new token per request, the root expanded) and at depth --depth;
a later step's latency is (T_depth - T_1) / (depth - 1): one forward of n*w frontier
tokens plus the [n, w*V] top-k. Median of --repeats calls after a warm-up. Prints a
table, writes results.json and draft_step.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from adaserve.drafter import DraftUpdate  # noqa: E402
from adaserve.model.loader import load_runner  # noqa: E402
from adaserve.speculate import BeamDrafter  # noqa: E402

SMOL_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
TINY_SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def random_model(shape: dict, where: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(where)
    return where


def drafter_path(name: str, tmp: Path) -> str | Path:
    if name == "embedded":
        return "embedded"
    return random_model(SMOL_SHAPE if name == "smol-shape" else TINY_SHAPE, tmp / name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Session:
    """A drafter with n live requests; each call commits one new token per request."""

    def __init__(self, runner, n: int, prompt_len: int, rng: np.random.Generator) -> None:
        self.drafter = BeamDrafter(runner)
        self.rng = rng
        self.ids = [f"r{i}" for i in range(n)]
        self.lens = {i: prompt_len for i in self.ids}
        prompts = [self._tokens(prompt_len) for _ in self.ids]
        self.drafter.speculate(
            [DraftUpdate(i, p, prompt_len) for i, p in zip(self.ids, prompts, strict=True)], 1, 1
        )

    def _tokens(self, k: int) -> np.ndarray:
        return self.rng.integers(0, 49152, k).astype(np.int32)

    def call(self, depth: int, width: int, device: torch.device) -> float:
        updates = []
        for i in self.ids:
            self.lens[i] += 1
            updates.append(DraftUpdate(i, self._tokens(1), self.lens[i]))
        sync(device)
        t0 = time.perf_counter()
        self.drafter.speculate(updates, depth, width)
        sync(device)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.drafter.release(self.ids)


def grid(max_tokens: int, widths: list[int]) -> list[tuple[int, int]]:
    ns = [1, 2, 4, 8, 16, 32, 64]
    return [(n, w) for w in widths for n in ns if n * w <= max_tokens]


def bench(name: str, path, args, device: torch.device) -> list[dict]:
    runner = load_runner(path, device=device, dtype=args.dtype, kv_blocks=args.kv_blocks)
    rng = np.random.default_rng(0)
    rows = []
    for n, w in grid(args.max_tokens, args.widths):
        sess = Session(runner, n, args.prompt_len, rng)
        for _ in range(2):  # warm-up
            sess.call(1, w, device)
            sess.call(args.depth, w, device)
        t1 = [sess.call(1, w, device) for _ in range(args.repeats)]
        td = [sess.call(args.depth, w, device) for _ in range(args.repeats)]
        sess.close()
        step1, total = float(np.median(t1)), float(np.median(td))
        later = (total - step1) / (args.depth - 1)
        rows.append(
            dict(
                drafter=name,
                n=n,
                w=w,
                tokens=n * w,
                step1_ms=step1 * 1e3,
                step_ms=later * 1e3,
                speculate_ms=total * 1e3,
                depth=args.depth,
            )
        )
        r = rows[-1]
        print(
            f"{name:>10} n={n:>3} w={w} n*w={n * w:>3}  step1 {r['step1_ms']:8.2f} ms  "
            f"later step {r['step_ms']:8.2f} ms  speculate(d={args.depth}) "
            f"{r['speculate_ms']:8.2f} ms",
            flush=True,
        )
    assert runner.kv_usage() == 0.0, "bench leaked draft KV"
    return rows


def plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sorted({r["drafter"] for r in rows}):
        for w in sorted({r["w"] for r in rows}):
            sel = sorted(
                (r for r in rows if r["drafter"] == name and r["w"] == w), key=lambda r: r["tokens"]
            )
            if sel:
                ax.plot(
                    [r["tokens"] for r in sel],
                    [r["step_ms"] for r in sel],
                    marker="o",
                    label=f"{name}, w={w}",
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("frontier tokens per draft step (n*w)")
    ax.set_ylabel("draft step latency (ms, median)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "draft_step.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--drafters",
        nargs="+",
        default=["embedded", "tiny"],
        choices=["embedded", "tiny", "smol-shape"],
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--kv-blocks", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_draft")
    args = ap.parse_args()
    if args.depth < 2:
        ap.error("--depth must be >= 2 (later steps are measured as T_depth - T_1)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.drafters:
            rows += bench(name, drafter_path(name, Path(tmp)), args, device)
    meta = dict(
        device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        dtype=args.dtype,
        depth=args.depth,
        repeats=args.repeats,
        prompt_len=args.prompt_len,
        loadavg=os.getloadavg()[0],
    )
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out, f"BeamDrafter step latency ({meta['device']}, {meta['threads']} threads)")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'draft_step.png'}")


if __name__ == "__main__":
    main()
