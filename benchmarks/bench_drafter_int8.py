"""Speculation with the fp32 and the int8 drafter against plain decoding, in one engine.

Builds the engine of `configs/embedded-cpu.yaml` once, plus a second drafter with
`model.drafter_quantization: int8`, and runs the same single requests (64 greedy
tokens, ignore_eos) with no drafter, the fp32 drafter and the int8 one in turn, round
after round (round k uses prompt k). Alternating within a round keeps this host's
minute-to-minute drift out of the ratios; the medians of the per-round ratios are
reported, with the verification steps each mode took (equal steps: equal acceptance)
and whether all three wrote the same tokens (they must).

    HF_HUB_OFFLINE=1 GOMP_SPINCOUNT=30000 .venv/bin/python benchmarks/bench_drafter_int8.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path

from bench_spec_server import PROMPTS

from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.engine_build import build_drafter, build_engine
from adaserve.request import GenerationRequest, SamplingParams


def one(engine: Engine, prompt: str, max_tokens: int) -> tuple[float, int, list[int]]:
    """tokens/s, iterations and tokens of one request run alone to completion."""
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    stream = engine.submit(
        GenerationRequest(
            id=uuid.uuid4().hex, prompt_token_ids=tuple(ids), sampling=sampling, tpot_slo_ms=1e3
        )
    )
    t0, it0 = time.perf_counter(), engine.stats().iterations
    while engine.has_work():
        engine.step()
    tokens: list[int] = []
    while (d := stream.get(timeout=0)) is not None:
        tokens.extend(d.token_ids)
    return len(tokens) / (time.perf_counter() - t0), engine.stats().iterations - it0, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/embedded-cpu.yaml")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="out/bench_drafter_int8")
    args = p.parse_args()

    engine = build_engine(load_settings(args.config, model={"drafter_quantization": "none"}))
    raw = build_drafter(load_settings(args.config, model={"drafter_quantization": "int8"}))
    if raw is None:
        raise SystemExit(f"{args.config} names no drafter: nothing to compare")
    int8 = engine.wrap_drafter(raw, engine.draft_history)
    modes = {"plain": None, "fp32": engine.drafter, "int8": int8}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    steps = dict.fromkeys(modes, 0)
    identical = True
    one(engine, PROMPTS[0], 8)  # warm-up
    for k in range(args.rounds):
        outs = {}
        for mode, drafter in modes.items():
            engine.drafter = drafter
            rate, it, outs[mode] = one(engine, PROMPTS[k % len(PROMPTS)], args.max_tokens)
            rates[mode].append(rate)
            steps[mode] += it
        identical &= outs["plain"] == outs["fp32"] == outs["int8"]
        print(f"round {k}: " + ", ".join(f"{m} {r[-1]:.1f}" for m, r in rates.items()), flush=True)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

    result = {
        "tokens_per_s_median": {m: statistics.median(r) for m, r in rates.items()},
        "verification_steps": steps,
        "fp32_over_plain": ratio("fp32", "plain"),
        "int8_over_plain": ratio("int8", "plain"),
        "int8_over_fp32": ratio("int8", "fp32"),
        "identical_output": identical,
        "rates": rates,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rates"}, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
