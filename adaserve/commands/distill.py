"""`adaserve distill`: train a small drafter that imitates a target model.

Example (the shipped embedded drafter was trained with a GPU version of this):
    adaserve distill --target embedded --out my-drafter --layers 2 --steps 2000

`--kind eagle` trains an EAGLE head instead (one decoder layer over the target's
features at `--feature-layers`; adaserve/distill/eagle_pipeline.py):
    adaserve distill --kind eagle --target embedded --out my-eagle --time-budget-s 1500
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "distill" / "prompts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", required=True, help="target model: HF directory, GGUF file, or 'embedded'"
    )
    p.add_argument("--out", required=True, type=Path, help="output drafter directory")
    p.add_argument(
        "--kind",
        choices=("model", "eagle"),
        default="model",
        help="model: a small distilled Llama; eagle: a head on the target's hidden states",
    )
    p.add_argument(
        "--target-name", help="target recorded in the drafter's config (default: --target)"
    )
    p.add_argument("--work-dir", type=Path, help="caches and checkpoints (default: OUT.work)")
    p.add_argument("--resume", action="store_true", help="continue from the work dir's checkpoint")
    p.add_argument(
        "--layers", default="2", help="decoder layers; a comma list trains several side by side"
    )
    p.add_argument(
        "--draft-vocab", type=int, default=8192, help="draft vocabulary size (LM head rows)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps (default 1000 without --time-budget-s)",
    )
    p.add_argument("--time-budget-s", type=float, default=None, help="training time limit")
    p.add_argument("--batch-size", type=int, default=8192, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--weight-format",
        choices=("float", "int8_rowwise"),
        default=None,
        help="default: float for --kind model, int8_rowwise for --kind eagle",
    )
    p.add_argument("--train-prompts", type=Path, default=PROMPTS / "train.jsonl")
    p.add_argument("--heldout-prompts", type=Path, default=PROMPTS / "heldout.jsonl")
    g = p.add_argument_group("target generation")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--gen-batch", type=int, default=32)
    g.add_argument("--sample-passes", type=int, default=1, help="sampled continuations per prompt")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--gen-time-budget-s", type=float, default=None)
    g.add_argument("--max-prompts", type=int, default=None, help="use only this many train prompts")
    g.add_argument(
        "--max-heldout", type=int, default=None, help="measure on only this many held-out prompts"
    )
    g.add_argument("--heldout-max-new-tokens", type=int, default=192)
    g.add_argument(
        "--gen-workers", type=int, default=1, help="CPU: single-threaded generation processes"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy CPU)"
    )
    p.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("--kind eagle")
    e.add_argument(
        "--feature-layers",
        default=None,
        help="target layers the head reads, comma list (default: 2, middle, last, e.g. 2,15,29)",
    )
    e.add_argument("--head-layers", type=int, default=1, help="decoder layers in the head")
    e.add_argument(
        "--ttt-steps", type=int, default=4, help="steps unrolled on the head's own outputs"
    )
    e.add_argument(
        "--init-from", type=int, default=None, help="target layer the head starts from (last)"
    )
    e.add_argument(
        "--draft-vocab-file",
        type=Path,
        default=None,
        help="reuse this d2t file (e.g. a drafter's draft_vocab.safetensors) instead of counting",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from adaserve.distill.pipeline import DistillJob, GenSettings, run
    from adaserve.distill.train import TrainConfig
    from adaserve.distill.weights import read_config
    from adaserve.model.embedded import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        layers = tuple(int(x) for x in str(args.layers).split(","))
        device = (
            args.device
            if args.device != "auto"
            else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        work = args.work_dir or args.out.with_name(args.out.name + ".work")
        steps = args.steps if args.steps or args.time_budget_s else 1000
        target_dir = resolve_model(args.target, "target")
        feature_layers: tuple[int, ...] = ()
        if args.kind == "eagle":
            feature_layers = _feature_layers(args.feature_layers, read_config(target_dir))
        weight_format = args.weight_format or ("int8_rowwise" if args.kind == "eagle" else "float")
        job = DistillJob(
            target_dir=target_dir,
            target_spec=args.target_name
            or (args.target if args.target == "embedded" else str(Path(args.target).resolve())),
            out=args.out,
            work=work,
            layers=layers,
            draft_vocab=args.draft_vocab,
            train=TrainConfig(
                steps=steps,
                time_budget_s=args.time_budget_s,
                batch_tokens=args.batch_size,
                lr=args.lr,
                max_len=args.max_len,
                seed=args.seed,
            ),
            gen=GenSettings(
                max_new_tokens=args.max_new_tokens,
                batch=args.gen_batch,
                sample_passes=args.sample_passes,
                temperature=args.temperature,
                time_budget_s=args.gen_time_budget_s,
                max_prompts=args.max_prompts,
                max_heldout=args.max_heldout,
                writer_max_new_tokens=min(160, args.max_new_tokens),
                workers=args.gen_workers if device == "cpu" else 1,
                heldout_max_new_tokens=args.heldout_max_new_tokens,
                feature_layers=feature_layers,
            ),
            device=device,
            train_prompts=args.train_prompts,
            heldout_prompts=args.heldout_prompts,
            resume=args.resume,
            weight_format=weight_format,
        )
        if args.kind == "eagle":
            return _run_eagle(args, job, feature_layers)
        report = run(job)
    except (ValueError, FileNotFoundError) as exc:
        print(f"adaserve distill: {exc}", file=sys.stderr)
        return 2
    for name, acc in report["students"].items():
        print(f"{name}: top-1 {acc['top1_agreement']:.3f}  mean emitted {acc['mean_emitted']:.3f}")
    print(f"drafter written to {args.out}")
    return 0


def _feature_layers(spec: str | None, target_cfg: dict) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high default: an early layer (token-level detail), the
    middle, and the last (what the target is about to say)."""
    n = int(target_cfg["num_hidden_layers"])
    if spec is None:
        return tuple(sorted({min(2, n - 1), n // 2, n - 1}))
    layers = tuple(int(x) for x in spec.split(","))
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"--feature-layers must be in 0..{n - 1}, got {spec}")
    return layers


def _run_eagle(args: argparse.Namespace, job, feature_layers: tuple[int, ...]) -> int:
    from adaserve.distill.eagle_pipeline import EagleSettings
    from adaserve.distill.eagle_pipeline import run as run_eagle

    settings = EagleSettings(
        feature_layers=feature_layers,
        head_layers=args.head_layers,
        ttt_steps=args.ttt_steps,
        init_from=args.init_from,
        draft_vocab_file=args.draft_vocab_file,
    )
    report = run_eagle(job, settings)
    acc = report["heldout"]
    print(
        f"eagle: top-1 {acc['top1_agreement']:.3f}  tokens per depth-{acc['depth']} step "
        f"{acc['mean_emitted']:.3f}"
    )
    print(f"drafter written to {args.out}")
    return 0
