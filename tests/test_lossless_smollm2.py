"""Losslessness on the embedded SmolLM2-135M-Instruct target, with (a) a random tiny
drafter sharing its vocabulary (near-zero acceptance), (b) the target drafting for
itself (near-full acceptance) and (c) the shipped drafter in the engine under the CPU
config `make up` serves with."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.model.loader import load_runner, load_tokenizer
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
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


def test_shipped_pair_under_the_cpu_config_is_lossless(smol):
    """The engine as `make up` runs it (configs/embedded-cpu.yaml: int8 drafter,
    confidence-stopped beam search, cost cap) against plain greedy decoding, one
    request alone and three with mixed SLOs; the stop rule really cuts trees."""
    target, prompts, ref = smol
    config = Path(__file__).parents[1] / "configs" / "embedded-cpu.yaml"
    settings = load_settings(config, slo={"baseline_tpot_ms": 50.0})
    stop = settings.scheduler.adaptive.draft_stop_prob
    assert stop is not None
    draft = load_runner(
        "embedded",
        device="cpu",
        dtype="float32",
        role="drafter",
        kv_blocks=128,
        quantization="int8",
    )
    drafter = BeamDrafter(draft)
    depths: list[int] = []
    inner = drafter.speculate

    def recording(updates, depth, width, stop_prob=0.0):
        assert stop_prob == stop
        trees = inner(updates, depth, width, stop_prob)
        depths.extend(int(t.depths().max()) for t in trees)
        return trees

    drafter.speculate = recording
    engine = Engine(
        RunnerTarget(target, eos_token_ids=()),
        drafter,
        LocalScheduler(settings.scheduler),
        settings,
    )
    for batch in (["p1"], ["p0", "p1", "p2"]):
        streams = {
            k: engine.submit(
                GenerationRequest(
                    f"{k}-{len(batch)}",
                    tuple(prompts[k]),
                    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                    tpot_slo_ms=[40.0, 100.0, 400.0][i],
                )
            )
            for i, k in enumerate(batch)
        }
        out = {k: [] for k in batch}
        for _ in range(200):
            engine.step()
            for k, s in streams.items():
                while (d := s.get(timeout=0)) is not None:
                    out[k].extend(d.token_ids)
            if not engine.has_work():
                break
        assert out == {k: ref[k] for k in batch}
    d_max = settings.scheduler.adaptive.d_max
    assert depths and max(depths) <= d_max
    assert len(set(depths)) > 1 and min(depths) < d_max  # trees were cut
    assert target.kv_usage() == 0.0 and draft.kv_usage() == 0.0


def test_ngram_and_merged_trees_on_a_summary_are_lossless(smol):
    """A summary copies its source: under the CPU config with the n-gram drafter beside
    the shipped one (which reads a window of each prompt), every method (alone and mixed in one batch) emits the target's own
    greedy output, n-gram drafts are accepted, and merged trees are verified."""
    import json

    from adaserve.ngram import NgramDrafter

    target, _, _ = smol
    tok = load_tokenizer("embedded")
    heldout = Path(__file__).parents[1] / "adaserve" / "distill" / "prompts" / "heldout.jsonl"
    rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    texts = [r["messages"] for r in rows if r.get("category") == "summarize"][:3]
    texts.append(next(r["messages"] for r in rows if r.get("category") == "chat"))
    prompts = {
        ("s0", "s1", "s2", "c0")[k]: tok(
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for k, m in enumerate(texts)
    }
    n = 40
    ref, _ = generate(target, prompts, n)
    config = Path(__file__).parents[1] / "configs" / "embedded-cpu.yaml"
    # The draft model reads only each prompt's last 32 tokens (the default window, 512,
    # is longer than these prompts), the n-gram drafter all of them.
    assert min(len(p) for p in prompts.values()) > 32
    settings = load_settings(
        config, slo={"baseline_tpot_ms": 50.0}, speculation={"draft_context": 32}
    )
    draft = load_runner(
        "embedded",
        device="cpu",
        dtype="float32",
        role="drafter",
        kv_blocks=128,
        quantization="int8",
    )
    engine = Engine(
        RunnerTarget(target, eos_token_ids=()),
        BeamDrafter(draft),
        LocalScheduler(settings.scheduler),
        settings,
        ngram=NgramDrafter(),
    )
    runs = [
        [("s0", "ngram")],
        [("s1", "auto")],
        [("c0", "auto")],  # chat copies little: the model's and the n-gram trees merged
        [("s0", "auto"), ("s1", "ngram"), ("s2", "model"), ("c0", "none")],
    ]
    for batch in runs:
        streams = {
            k: engine.submit(
                GenerationRequest(
                    f"{k}-{m}-{len(batch)}",
                    tuple(prompts[k]),
                    SamplingParams(max_tokens=n, ignore_eos=True),
                    tpot_slo_ms=100.0,
                    speculation=m,
                )
            )
            for k, m in batch
        }
        out = {k: [] for k, _ in batch}
        for _ in range(300):
            engine.step()
            for k, s in streams.items():
                while (d := s.get(timeout=0)) is not None:
                    out[k].extend(d.token_ids)
            if not engine.has_work():
                break
        assert out == {k: ref[k] for k, _ in batch}
    stats = engine.method_stats
    # The summaries copied their sources: most verified n-gram tokens accepted (0.76 on
    # this run's pair; matches from one token on draft too, and those miss more often).
    assert stats["ngram"].accepted > 0.6 * stats["ngram"].drafted > 0
    assert stats["model+ngram"].drafted > 0
    assert target.kv_usage() == 0.0 and draft.kv_usage() == 0.0
