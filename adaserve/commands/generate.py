"""`adaserve generate`: the full speculate-select-verify loop for one prompt, in process.

It runs the same Engine as the servers (in-process drafter and scheduler), stepped
synchronously, so what it prints is what a server would stream.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from adaserve.config import ATTENTION_BACKEND_CHOICES, load_settings
from adaserve.request import GenerationRequest, SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="embedded", help="HF dir, .gguf file, or 'embedded'")
    p.add_argument("--drafter", default="embedded", help="HF dir, .gguf file, or 'embedded'")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the target")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="apply the chat template to --prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--depth", type=int, default=None, help="fixed tree depth (default: adaptive)")
    p.add_argument("--width", type=int, default=None, help="fixed beam width (default: adaptive)")
    p.add_argument("--budget", type=int, default=None, help="verifier token budget per iteration")
    p.add_argument("--tpot-slo-ms", type=float, default=50.0)
    p.add_argument("--no-speculation", action="store_true", help="plain decoding, same runtime")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKEND_CHOICES,
        help="model.attention_backend (default: settings, else auto)",
    )
    p.add_argument("--config", default=None, help="settings YAML")
    p.add_argument("--json", action="store_true", help="print a JSON result")


def run(args: argparse.Namespace) -> int:
    from services.verifier.wiring import build_engine

    overrides: dict = {
        "model": {
            "target": args.target,
            "drafter": None if args.no_speculation else args.drafter,
            "tp": args.tp,
            "device": args.device,
            "dtype": args.dtype,
        },
        "engine": {"speculation": not args.no_speculation},
        "scheduler": {},
    }
    if args.attention_backend:
        overrides["model"]["attention_backend"] = args.attention_backend
    if args.budget is not None:
        overrides["scheduler"]["budget"] = args.budget
    if args.depth is not None or args.width is not None:
        overrides["scheduler"]["adaptive"] = {
            "policy": "fixed",
            "fixed_depth": args.depth or 4,
            "fixed_width": args.width or 1,
            "d_max": max(args.depth or 4, 1),
            "w_max": max(args.width or 1, 1),
            # an explicit depth is that depth: a config's confidence stop would cut it
            "draft_stop_prob": None,
        }
    try:
        settings = load_settings(args.config, **overrides)
        sampling = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"adaserve generate: {exc}", file=sys.stderr)
        return 2

    t_load = time.perf_counter()
    try:
        engine = build_engine(settings)
    except (FileNotFoundError, ValueError) as exc:
        print(f"adaserve generate: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t_load

    tokenizer = engine.tokenizer
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            print(
                "adaserve generate: --prompt-ids must be comma-separated integers", file=sys.stderr
            )
            return 2
    elif tokenizer is None:
        print("adaserve generate: the model has no tokenizer; pass --prompt-ids", file=sys.stderr)
        return 2
    elif args.chat:
        prompt_ids = list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    else:
        prompt_ids = list(tokenizer.encode(args.prompt, add_special_tokens=False))

    try:
        req = GenerationRequest(
            id=uuid.uuid4().hex,
            prompt_token_ids=tuple(prompt_ids),
            sampling=sampling,
            tpot_slo_ms=args.tpot_slo_ms,
        )
        stream = engine.submit(req)
    except ValueError as exc:
        print(f"adaserve generate: {exc}", file=sys.stderr)
        return 2

    token_ids: list[int] = []
    text_parts: list[str] = []
    decode_steps = decode_tokens = 0
    finish = None
    error = None
    t0 = time.perf_counter()
    t_first = None
    while finish is None:
        engine.step()
        while (delta := stream.get(timeout=0)) is not None:
            if delta.token_ids:
                if t_first is None:
                    t_first = time.perf_counter()
                else:  # every chunk after the first is one verification step
                    decode_steps += 1
                    decode_tokens += len(delta.token_ids)
            token_ids.extend(delta.token_ids)
            text_parts.append(delta.text)
            finish, error = delta.finish_reason, delta.error
            if not args.json and delta.text:
                print(delta.text, end="", flush=True)
    elapsed = time.perf_counter() - t0
    decode_s = time.perf_counter() - (t_first or t0)
    stats = {
        "iterations": decode_steps + 1,
        "mean_accepted": decode_tokens / decode_steps if decode_steps else 1.0,
        "num_tokens": len(token_ids),
        "prompt_tokens": len(prompt_ids),
        "elapsed_s": round(elapsed, 4),
        "ttft_s": round((t_first or t0) - t0, 4),
        "tokens_per_s": round(len(token_ids) / elapsed, 2) if elapsed > 0 else None,
        "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
        "load_s": round(load_s, 2),
        "finish_reason": finish,
        "speculative": engine.drafter is not None,
    }
    if args.json:
        out = {"token_ids": token_ids, "text": "".join(text_parts), "stats": stats}
        if error:
            out["error"] = error
        print(json.dumps(out))
    else:
        print()
        print(json.dumps(stats), file=sys.stderr)
    return 0 if finish in ("stop", "length") else 1
