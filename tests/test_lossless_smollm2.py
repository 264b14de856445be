"""Losslessness on the embedded SmolLM2-135M-Instruct target, with (a) a random tiny
drafter sharing its vocabulary (near-zero acceptance) and (b) the target drafting for
itself (near-full acceptance)."""

from __future__ import annotations

import pytest

from adaserve.model.loader import load_runner, load_tokenizer
from adaserve.speculate import BeamDrafter
from tests._spec_loop import generate, hf_greedy, random_budget
from tests._stats import single_thread
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 20  # a multiple of depth + 1: no step is cut short by the length cap
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The CPU is shared: one intra-op thread per process avoids barrier stalls.
    with single_thread():
        yield


def _runner(path):
    return load_runner(path, device="cpu", dtype="float32", kv_blocks=128, kv_block_size=16)


@pytest.fixture(scope="module")
def smol():
    """(target runner, prompts, plain greedy outputs through the same runner)."""
    tok = load_tokenizer("embedded")
    prompts = {f"p{k}": tok(t)["input_ids"] for k, t in enumerate(TEXTS)}
    target = _runner("embedded")
    ref, _ = generate(target, prompts, MAX_TOKENS)
    return target, prompts, ref


def test_plain_decoding_matches_hugging_face(smol, embedded_dir):
    _, prompts, ref = smol
    assert ref["p0"] == hf_greedy(embedded_dir, prompts["p0"], MAX_TOKENS)


def test_random_drafter_sharing_the_vocabulary(smol, tmp_path):
    target, prompts, ref = smol
    drafter_dir = make_tiny_model(tmp_path / "rand", vocab_size=49152, seed=1)
    draft = _runner(drafter_dir)
    out, stats = generate(
        target,
        prompts,
        MAX_TOKENS,
        drafter=BeamDrafter(draft),
        depth=3,
        width=2,
        budget=random_budget,
        seed=1,
    )
    assert out == ref
    assert sum(stats.accepted) <= 2  # a random drafter is (almost) never right
    assert target.kv_usage() == 0.0 and draft.kv_usage() == 0.0


def test_target_as_its_own_drafter(smol):
    target, prompts, ref = smol
    draft = _runner("embedded")
    depth, width = 4, 1
    out, stats = generate(
        target,
        prompts,
        MAX_TOKENS,
        drafter=BeamDrafter(draft),
        depth=depth,
        width=width,
        budget=lambda n, rng: n * (1 + depth * width),
        policy="global",  # every drafted node verified: acceptance itself is under test
    )
    assert out == ref
    assert sum(stats.accepted) / len(stats.accepted) > 3
    assert target.kv_usage() == 0.0 and draft.kv_usage() == 0.0
