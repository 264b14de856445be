"""`adaserve up --drafter EAGLE_DIR` as a user runs it, in both layouts (the head in the
verifier's process, and a drafter service fed the target's features over gRPC): the
OpenAI API's greedy output with `speculation.method: eagle` is the target's own, the
head drafted (the per-method metrics), and a unit without a head refuses eagle."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest

from tests._eagle import make_eagle_dir
from tests._serving import make_served_model
from tests._up import launch_up, wait_for_line

pytestmark = pytest.mark.slow

PROMPTS = ["hello there", "abc abc abc", "the cat sat on"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle-up")
    target = make_served_model(root / "target", seed=0)
    head = make_eagle_dir(root / "eagle", target, feature_layers=(0, 1), draft_vocab=200)
    return target, head


def _eagle_steps(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    m = re.search(r'adaserve_spec_decode_method_steps_total\{method="eagle"\} (\S+)', text)
    return float(m[1]) if m else 0.0


@pytest.mark.parametrize("layout", ["all-in-one", "separate"])
def test_up_with_an_eagle_head_is_lossless(models, tmp_path: Path, layout: str) -> None:
    target, head = models
    args = ["--target", str(target), "--drafter", str(head)]
    if layout == "all-in-one":
        args.append("--all-in-one")
    proc, port = launch_up(tmp_path, *args)
    try:
        text = wait_for_line(proc, r"Press Ctrl-C")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

        def complete(prompt: str, method: str) -> str:
            out = client.completions.create(
                model="target",
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True, "speculation": {"method": method}},
            )
            assert out.usage.completion_tokens == 24
            return out.choices[0].text

        for prompt in PROMPTS:
            assert complete(prompt, "eagle") == complete(prompt, "none"), prompt
        with pytest.raises(openai.BadRequestError, match="not available"):
            complete("x", "model")  # the unit's drafter is the head
        metrics = re.search(r"metrics\s+(\S+)\s+\(verifier-0: engine\)", text)
        assert metrics, text
        assert _eagle_steps(metrics[1]) > 0
    finally:
        proc.stop()
