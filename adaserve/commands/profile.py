"""`adaserve profile`: measure a hardware profile (and an acceptance trace) on this machine.

    adaserve profile --target embedded --drafter embedded --out profile.yaml
    adaserve profile --target DIR --drafter DIR --out p.yaml --trace acceptance.jsonl

The profile YAML is the format `adaserve simulate` reads (workload `profile:` field);
the trace feeds the simulator's `acceptance: {mode: replay, trace: ...}`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="embedded", help="target model: HF dir, .gguf or embedded")
    p.add_argument(
        "--drafter", default="embedded", help="drafter model (HF dir, .gguf, embedded) or 'none'"
    )
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.add_argument("--name", help="profile name (default: the output file's stem)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--tokens", help="verify token counts, comma-separated (default 1..64)")
    p.add_argument("--max-tokens", type=int, help="drop verify points above this")
    p.add_argument("--contexts", help="total cached context values, comma-separated")
    p.add_argument("--reps", type=int, help="timed repetitions per point (median)")
    p.add_argument("--trace", help="also record an acceptance trace (JSONL) here")
    p.add_argument("--trace-steps", type=int, default=32, help="decoding steps per prompt")
    p.add_argument("--trace-depth", type=int, default=4)
    p.add_argument("--trace-width", type=int, default=2)
    p.add_argument("--trace-prompts", type=int, default=6, help="prompts decoded for the trace")
    p.add_argument(
        "--trace-prompt-len", type=int, default=24, help="length of random trace prompts"
    )
    p.add_argument(
        "--trace-random-prompts",
        metavar="LO,HI",
        help="random token-id prompts from [LO, HI), as `adaserve bench serve` sends",
    )
    p.add_argument(
        "--drafter-quantization",
        choices=["none", "int8", "int4"],
        default="none",
        help="profile the drafter as model.drafter_quantization runs it (int8: on a CPU)",
    )
    p.add_argument(
        "--quantization",
        choices=["auto", "none", "stored", "int8", "int4"],
        default="auto",
        help="profile the target as model.quantization runs it (auto: a GGUF's stored "
        "blocks on a CPU, as served by default)",
    )
    p.add_argument(
        "--stored-activations",
        choices=["float32", "int8"],
        default="float32",
        help="what stored / int4 weights multiply (model.stored_activations; "
        "configs/embedded-cpu.yaml serves int8)",
    )
    p.add_argument("--quiet", action="store_true")


def _ints(s: str | None) -> list[int] | None:
    return [int(x) for x in s.split(",") if x.strip()] if s else None


def run(args: argparse.Namespace) -> int:
    from adaserve.model.loader import load_runner, load_tokenizer
    from adaserve.sim.costmodel import save_profile
    from adaserve.sim.measure import grid_from_args, measure_profile

    log = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    random_ids = _ints(args.trace_random_prompts)
    if random_ids is not None and (len(random_ids) != 2 or not 0 <= random_ids[0] < random_ids[1]):
        print(
            "adaserve profile: --trace-random-prompts takes LO,HI with 0 <= LO < HI",
            file=sys.stderr,
        )
        return 2
    try:
        grid = grid_from_args(_ints(args.tokens), _ints(args.contexts), args.reps, args.max_tokens)
        target = load_runner(
            args.target,
            args.device,
            args.dtype,
            threads=args.threads,
            quantization=args.quantization,
            stored_activations=args.stored_activations,
        )
        drafter = None
        if args.drafter != "none":
            drafter = load_runner(
                args.drafter,
                args.device,
                args.dtype,
                role="drafter",
                quantization=args.drafter_quantization,
                stored_activations=args.stored_activations,
            )
        if random_ids is not None and random_ids[0] >= target.vocab_size:
            raise ValueError(
                f"--trace-random-prompts: LO {random_ids[0]} is not below the vocabulary "
                f"size {target.vocab_size}"
            )
    except (FileNotFoundError, ValueError) as exc:
        print(f"adaserve profile: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    profile = measure_profile(
        target,
        drafter,
        name=args.name or out.stem,
        grid=grid,
        description=f"measured by `adaserve profile` on {target.device}",
        target_name=str(args.target),
        drafter_name=str(args.drafter),
        log=log,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out)
    print(
        f"wrote {out}: budget {profile.budget} tokens, baseline "
        f"{profile.baseline_ms():.1f} ms/token, verify(1) {profile.verify_ms(1, 0):.1f} ms"
    )
    if args.trace:
        if drafter is None:
            print("adaserve profile: --trace needs a drafter", file=sys.stderr)
            return 2
        from adaserve.sim.record import prompt_ids, write_trace

        try:
            tok = load_tokenizer(args.target)
        except Exception:  # a bare checkpoint: random prompts still give a valid trace
            tok = None
        prompts = prompt_ids(
            tok,
            int(target.vocab_size),
            args.trace_prompts,
            random_ids=(random_ids[0], random_ids[1]) if random_ids else None,  # checked: LO,HI
            length=args.trace_prompt_len,
        )
        n = write_trace(
            Path(args.trace),
            target,
            drafter,
            prompts,
            depth=args.trace_depth,
            width=args.trace_width,
            steps=args.trace_steps,
        )
        print(f"wrote {args.trace}: {n} node records")
    return 0
