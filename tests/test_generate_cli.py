"""`adaserve generate --json` with the embedded pair, as a user runs it: the speculative
loop's tokens equal plain decoding's (the default stored target, int8 activations),
plain decoding with float32 activations equals Hugging Face's greedy `generate`, and
`stats.mean_accepted` is tokens per verification step of the depth asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaserve.model.loader import load_tokenizer
from tests._spec_loop import hf_greedy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
PROMPT = "Write a Python function that reverses a string."
MAX_TOKENS = 24


def _generate(*extra: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "adaserve",
            "generate",
            "--target",
            "embedded",
            "--prompt",
            PROMPT,
            "--chat",
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_generate_json_is_lossless_and_reports_mean_accepted(embedded_dir: Path) -> None:
    # The CPU config's confidence stop must not cut an explicit --depth.
    spec = _generate(
        "--drafter",
        "embedded",
        "--depth",
        "4",
        "--width",
        "1",
        "--config",
        str(ROOT / "configs" / "embedded-cpu.yaml"),
    )
    plain = _generate("--no-speculation", "--config", str(ROOT / "configs" / "embedded-cpu.yaml"))
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    tok = load_tokenizer("embedded")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(ids, add_special_tokens=False)
    assert spec["stats"]["prompt_tokens"] == len(prompt)
    # The stored target with float32 activations computes the float32 model's logits.
    exact = _generate("--no-speculation", env={"ADASERVE_MODEL__STORED_ACTIVATIONS": "float32"})
    assert exact["token_ids"] == hf_greedy(embedded_dir, prompt, MAX_TOKENS)
    s = spec["stats"]
    assert s["speculative"] and not plain["stats"]["speculative"]
    assert s["num_tokens"] == MAX_TOKENS and s["finish_reason"] == "length"
    # The shipped drafter predicts this code prompt well: a depth-4 chain emits several
    # tokens per step, never more than depth + 1.
    assert 2.5 < s["mean_accepted"] <= 5.0
    assert plain["stats"]["mean_accepted"] == 1.0


def test_budget_one_runs_and_is_lossless(embedded_dir: Path) -> None:
    # --budget 1 (the smallest the help allows) built a knee prior (1, 1, 2) whose token
    # counts do not increase, and the command died before generating anything.
    spec = _generate("--drafter", "embedded", "--budget", "1", "--max-tokens", "8")
    tok = load_tokenizer("embedded")
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    assert spec["token_ids"] == hf_greedy(embedded_dir, prompt, 8)
    assert spec["stats"]["num_tokens"] == 8 and spec["stats"]["finish_reason"] == "length"
