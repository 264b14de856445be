"""Sampling is lossless: speculative samples follow the target's exact distribution,
and a seeded request emits the same tokens with or without speculation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from adaserve.model.loader import load_runner
from adaserve.request import SamplingParams
from adaserve.sampling import TokenRng, filtered_probs, row_params
from adaserve.speculate import BeamDrafter
from tests._spec_loop import generate, random_budget
from tests._stats import chi_square_pvalue, single_thread
from tests.conftest import make_tiny_model

VOCAB = 8
SP = SamplingParams(temperature=0.9, top_k=6, top_p=0.97, max_tokens=2, ignore_eos=True)
PROMPT = [1, 5, 2, 7]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    base = tmp_path_factory.mktemp("vocab8")
    # A hotter init than the default tiny model, so the distributions are far from
    # uniform and top-k / top-p really cut.
    target = make_tiny_model(base / "target", vocab_size=VOCAB, seed=21, initializer_range=0.5)
    drafter = make_tiny_model(base / "drafter", vocab_size=VOCAB, seed=22, initializer_range=0.5)
    return target, drafter


def _runner(path, blocks=4096):
    return load_runner(path, device="cpu", dtype="float32", kv_blocks=blocks, kv_block_size=4)


@torch.no_grad()
def _exact_two_token_distribution(path) -> np.ndarray:
    """P(y1, y2 | PROMPT) under the filtered target, from transformers (an independent
    implementation of the target)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def probs(seq):
        logits = model(torch.tensor([seq])).logits[0, -1:].float()
        return filtered_probs(logits, *row_params([SP], [1], logits.device))[0].double().numpy()

    p1 = probs(PROMPT)
    return np.array(
        [p1[a] * probs([*PROMPT, a])[b] for a, b in itertools.product(range(VOCAB), repeat=2)]
    )


def test_speculative_samples_follow_the_target_distribution(tiny_vocab):
    target_dir, drafter_dir = tiny_vocab
    exact = _exact_two_token_distribution(target_dir)
    assert (exact == 0).any() and exact.max() < 0.5  # filters cut, and it is not trivial
    target, draft, self_draft = _runner(target_dir), _runner(drafter_dir), _runner(target_dir)
    # Odd rounds draft with the target itself (drafts often accepted), even rounds with
    # an unrelated model (mostly rejected): both branches of the sampled walk get used.
    drafters = [BeamDrafter(draft), BeamDrafter(self_draft)]
    counts = np.zeros(VOCAB * VOCAB)
    accepted: list[int] = []
    batch, rounds = 250, 16
    for r in range(rounds):
        prompts = {f"s{r}-{k}": PROMPT for k in range(batch)}
        rngs = {sid: TokenRng(r * batch + k) for k, sid in enumerate(prompts)}
        out, stats = generate(
            target,
            prompts,
            2,
            drafter=drafters[r % 2],
            depth=2,
            width=2,
            budget=random_budget,
            sp=SP,
            rngs=rngs,
            seed=r,
        )
        for toks in out.values():
            counts[toks[0] * VOCAB + toks[1]] += 1
        accepted += stats.accepted
    assert counts[exact == 0].sum() == 0, "emitted a token the filters exclude"
    assert chi_square_pvalue(counts, exact) > 1e-3
    # Speculation really did something: drafts were accepted, and rejected.
    assert 0.1 < np.mean(np.array(accepted) > 0) < 0.9
    assert target.kv_usage() == draft.kv_usage() == self_draft.kv_usage() == 0.0


def test_seeded_output_is_identical_with_and_without_speculation(tiny_llama_dir, tmp_path):
    drafter_dir = make_tiny_model(tmp_path / "d", seed=5)
    rng = np.random.default_rng(0)
    prompts = {f"r{k}": rng.integers(0, 256, 1 + 3 * k).tolist() for k in range(5)}
    sps = {
        "r0": SamplingParams(temperature=1.0, seed=1, max_tokens=20),
        "r1": SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=20),
        "r2": SamplingParams(temperature=1.3, top_k=20, seed=3, max_tokens=20),
        "r3": SamplingParams(max_tokens=20),  # greedy beside sampled ones
        "r4": SamplingParams(temperature=0.5, top_k=5, top_p=0.8, seed=4, max_tokens=20),
    }

    def run(**kw):
        rngs = {i: TokenRng(sp.seed) for i, sp in sps.items() if sp.seed is not None}
        return generate(_runner(tiny_llama_dir), prompts, 20, sp=sps, rngs=rngs, **kw)[0]

    plain = run()
    assert (
        run(drafter=BeamDrafter(_runner(tiny_llama_dir)), depth=4, width=2, budget=random_budget)
        == plain
    )
    assert (
        run(drafter=BeamDrafter(_runner(drafter_dir)), depth=3, width=3, budget=random_budget)
        == plain
    )
    # ...and a different seed gives a different sample (the seed is really used).
    sps["r0"] = SamplingParams(temperature=1.0, seed=99, max_tokens=20)
    assert run()["r0"] != plain["r0"]
