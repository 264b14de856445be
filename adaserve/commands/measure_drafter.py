"""`adaserve measure-drafter`: a drafter's acceptance against its target on held-out
prompts, and its per-token cost.

Greedy: the target writes each prompt's continuation, the drafter predicts every
continuation token teacher-forced; top-1 agreement and the mean tokens emitted per
verification step of a width-1 depth-`--depth` chain (bonus included) follow exactly
(adaserve/distill/measure.py). Cost: median decode-step latency of the runtime's runner
for each model, one sequence, on the CPU.

`--drafter` takes several drafters, measured on the same target continuations (one
generation); `ngram` names the n-gram drafter (adaserve/ngram.py), whose chain steps
are simulated draft by draft and whose cost is the mean time of one depth-`--depth`
draft. An EAGLE head (`embedded-eagle` or a directory whose config says
`adaserve_drafter_kind: eagle`) reads the target's features, captured while the target
writes the continuations; its j-th draft reads its own (j-1)-th output, so its chain
steps are computed exactly, draft by draft (adaserve/distill/eagle_measure.py).

    adaserve measure-drafter --target embedded --drafter embedded --limit 48
    adaserve measure-drafter --drafter embedded ngram --per-category 12 --json
    adaserve measure-drafter --drafter embedded embedded-eagle ngram --limit 48
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "distill" / "prompts" / "heldout.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="embedded", help="target: HF dir, GGUF file or 'embedded'")
    p.add_argument(
        "--drafter",
        nargs="+",
        default=["embedded"],
        help="drafter directories, 'embedded', 'embedded-eagle' or 'ngram' (several: one "
        "table each)",
    )
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL with 'messages' rows")
    p.add_argument("--limit", type=int, default=48, help="prompts to use (spread over the file)")
    p.add_argument(
        "--per-category",
        type=int,
        default=None,
        help="instead of --limit: the first N prompts of each category",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="prompts per target generation batch")
    p.add_argument("--workers", type=int, default=1, help="single-threaded generation processes")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--cost-steps", type=int, default=32, help="decode steps timed per model (0: skip)"
    )
    p.add_argument(
        "--drafter-quantization",
        choices=["none", "int8"],
        default="none",
        help="time the drafter as the runtime runs it with model.drafter_quantization "
        "(the acceptance is always the fp32 drafter's)",
    )
    p.add_argument(
        "--draft-context",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="also measure a draft model reading only the last N prompt tokens "
        "(speculation.draft_context), one figure per N",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _pick(rows: list[dict], limit: int, per_category: int | None = None) -> list[dict]:
    rows = [r for r in rows if "messages" in r]
    if per_category is not None:
        seen: dict[str, int] = defaultdict(int)
        picked = []
        for r in rows:
            cat = r.get("category", "all")
            if seen[cat] < per_category:
                seen[cat] += 1
                picked.append(r)
        return picked
    if limit >= len(rows):
        return rows
    step = len(rows) / limit  # spread over the file, which mixes categories
    return [rows[int(i * step)] for i in range(limit)]


def run(args: argparse.Namespace) -> int:
    import torch

    from adaserve.distill.data import Sequences, read_prompt_file
    from adaserve.distill.generate import generate_all
    from adaserve.distill.weights import load_teacher
    from adaserve.model.embedded import resolve_model
    from adaserve.model.loader import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if any(n < 1 for n in args.draft_context):
            raise ValueError(f"--draft-context: every N must be >= 1, got {args.draft_context}")
        target_dir = resolve_model(args.target, "target")
        rows = _pick(read_prompt_file(args.prompts), args.limit, args.per_category)
        tok = load_tokenizer(args.target)
        prompts = [
            tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
            for r in rows
        ]
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        teacher = load_teacher(target_dir)
        eagles = {n: _eagle_dir(n) for n in args.drafter}
        eagles = {n: d for n, d in eagles.items() if d is not None}
        layers = _feature_layers(eagles.values())
        conts = generate_all(
            teacher,
            prompt_ids,
            args.max_new_tokens,
            [int(tok.eos_token_id)],
            args.batch,
            workers=args.workers,
            target_dir=target_dir,
            desc="target greedy",
            feature_layers=layers,
        )
        data = Sequences.build(prompt_ids, conts)
        feats = None
        if layers:
            from adaserve.distill.eagle_data import build_features

            feats = (build_features(conts, len(layers) * teacher.shape.hidden), layers)
        results = {
            name: _measure(name, args, target_dir, data, rows, eagles.get(name), feats)
            for name in args.drafter
        }
    except (ValueError, FileNotFoundError) as exc:
        print(f"adaserve measure-drafter: {exc}", file=sys.stderr)
        return 2
    if args.json:
        if len(results) == 1:
            (result,) = results.values()
        else:
            result = {"target": str(target_dir), "prompts": str(args.prompts), "drafters": results}
        print(json.dumps(result, indent=2))
        return 0
    for name, result in results.items():
        _print(name, result, args.depth)
    return 0


def _eagle_dir(name: str) -> Path | None:
    from adaserve.distill.eagle_export import is_eagle_dir
    from adaserve.model.embedded import EAGLE_ASSET, EMBEDDED_EAGLE

    if name == EMBEDDED_EAGLE:
        if not is_eagle_dir(EAGLE_ASSET):
            raise FileNotFoundError(f"{EMBEDDED_EAGLE}: {EAGLE_ASSET} holds no EAGLE head")
        return EAGLE_ASSET
    return Path(name) if name != "ngram" and is_eagle_dir(Path(name)) else None


def _feature_layers(dirs) -> tuple[int, ...]:
    """Every layer any EAGLE head reads: the target generates once and keeps them all."""
    import json

    layers: set[int] = set()
    for d in dirs:
        layers |= set(json.loads((d / "config.json").read_text())["adaserve_eagle_feature_layers"])
    return tuple(sorted(layers))


def _measure(
    name: str,
    args: argparse.Namespace,
    target_dir: Path,
    data,
    rows,
    eagle_dir: Path | None = None,
    feats: tuple | None = None,  # (features [tokens, len(layers) * H], layers)
) -> dict:
    from adaserve.distill import measure

    steps, windows = None, {}
    if eagle_dir is not None:
        from adaserve.distill.eagle_measure import measure_eagle

        if feats is None:
            raise ValueError(f"{name}: no target features were captured")
        matches, steps = measure_eagle(eagle_dir, target_dir, data, feats[0], feats[1], args.depth)
        source = str(eagle_dir)
    elif name == "ngram":
        from adaserve.ngram import NgramDrafter

        drafter = NgramDrafter()
        t0 = time.perf_counter()
        matches, steps = measure.ngram_matches(data, args.depth, drafter)
        calls = sum(steps) + sum(len(m) for m in matches)  # depth-d drafts + top-1 probes
        draft_ms = (time.perf_counter() - t0) * 1000.0 / max(calls, 1)
        source = "ngram"
    else:
        from adaserve.distill.export import load_drafter
        from adaserve.model.embedded import resolve_model

        drafter_dir = resolve_model(name, "drafter")
        student, head, d2t = load_drafter(drafter_dir, target_dir)
        matches = measure.draft_matches(student, head, d2t, data)
        source = str(drafter_dir)
        windows = {
            str(n): measure.summarize(
                measure.draft_matches(student, head, d2t, data, context=n), args.depth
            ).as_dict()
            for n in args.draft_context
        }
    steps = steps or [measure.chain_steps(m, args.depth) for m in matches]
    overall = measure.summarize(matches, args.depth, steps)
    by_cat: dict[str, list] = defaultdict(list)
    for r, m, s in zip(rows, matches, steps, strict=True):
        by_cat[r.get("category", "all")].append((m, s))
    result = {
        "target": str(target_dir),
        "drafter": source,
        "prompts": str(args.prompts),
        **overall.as_dict(),
        "by_category": {
            c: measure.summarize([m for m, _ in ms], args.depth, [s for _, s in ms]).as_dict()
            for c, ms in sorted(by_cat.items())
        },
    }
    if windows:
        result["by_draft_context"] = windows
    if eagle_dir is not None:
        result["kind"] = "eagle"  # its cost is the serving side's (adaserve/eagle_drafter.py)
    elif name == "ngram":
        result["drafter_ms_per_draft"] = round(draft_ms, 3)
    elif args.cost_steps > 0:
        from adaserve.distill.cost import decode_ms_per_token

        t_ms = decode_ms_per_token(args.target, "target", args.cost_steps, threads=args.threads)
        d_ms = decode_ms_per_token(
            name,
            "drafter",
            args.cost_steps,
            threads=args.threads,
            quantization=args.drafter_quantization,
        )
        result.update(
            target_ms_per_token=round(t_ms, 3),
            drafter_ms_per_token=round(d_ms, 3),
            cost_ratio=round(t_ms / d_ms, 2),
            drafter_quantization=args.drafter_quantization,
        )
    return result


def _print(name: str, result: dict, depth: int) -> None:
    print(f"drafter {name}")
    print(f"held-out prompts: {result['sequences']}, continuation tokens: {result['tokens']}")
    print(f"top-1 agreement with the target's greedy token: {result['top1_agreement']:.3f}")
    print(
        f"mean tokens per verification step (depth-{depth} chain, bonus included): "
        f"{result['mean_emitted']:.3f}"
    )
    for c, a in result["by_category"].items():
        print(
            f"  {c:<10} top-1 {a['top1_agreement']:.3f}  mean emitted {a['mean_emitted']:.3f}  ({a['tokens']} tokens)"
        )
    for n, a in result.get("by_draft_context", {}).items():
        print(
            f"  reading the last {n} prompt tokens: top-1 {a['top1_agreement']:.3f}  "
            f"mean emitted {a['mean_emitted']:.3f}"
        )
    if "cost_ratio" in result:
        print(
            f"decode ms/token: target {result['target_ms_per_token']:.2f}, drafter "
            f"{result['drafter_ms_per_token']:.2f}: drafter {result['cost_ratio']:.1f}x cheaper"
        )
    if "drafter_ms_per_draft" in result:
        print(f"n-gram: {result['drafter_ms_per_draft']:.3f} ms per draft (no model)")
