"""Penalties, logit bias, min_p, min_tokens, bad words and allowed tokens: each matches
Hugging Face's own logits processor where it has one, a tree row is processed exactly
as that position alone (its own history), and the engine's output is the same with a
drafter (speculation on) as without, greedy and seeded, and greedy equals HF generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from adaserve import metrics
from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.logits_process import path_tokens, process_rows, token_logprobs
from adaserve.model.loader import load_runner
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.sampling import filtered_probs, row_min_p, row_params
from adaserve.scheduler import LocalScheduler
from adaserve.speculate import BeamDrafter
from adaserve.target import LogitsContext
from adaserve.tree import CandidateTree
from tests._engine import run_to_completion
from tests.conftest import make_tiny_model

V = 256
EOS = 2


def _ctx(sp: SamplingParams, prompt, output, masks=None) -> LogitsContext:
    return LogitsContext(
        sp, np.asarray(prompt, np.int32), np.asarray(output, np.int32), (EOS,), masks
    )


def _row(logits: torch.Tensor, sp: SamplingParams, prompt, output) -> torch.Tensor:
    root = CandidateTree.root_only(0)
    return process_rows(logits[None], root.parents, root.tokens, _ctx(sp, prompt, output))[0]


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(3)) * 4


PROMPT, OUTPUT = [5, 6, 7, 7, 9], [9, 11, 11, 11, 40]


def test_repetition_penalty_is_hugging_faces(logits: torch.Tensor) -> None:
    sp = SamplingParams(repetition_penalty=1.7)
    ids = torch.tensor([PROMPT + OUTPUT])
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[None].clone())[0]
    assert torch.equal(_row(logits, sp, PROMPT, OUTPUT), want)


def test_logit_bias_is_hugging_faces_sequence_bias(logits: torch.Tensor) -> None:
    bias = {17: 5.0, 3: -100.0, 200: 0.25}
    sp = SamplingParams(logit_bias=tuple(bias.items()))
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    want = hf(torch.tensor([PROMPT + OUTPUT]), logits[None].clone())[0]
    torch.testing.assert_close(_row(logits, sp, PROMPT, OUTPUT), want)


def test_bad_words_are_hugging_faces(logits: torch.Tensor) -> None:
    words = ((13,), (11, 40, 77), (9, 12), (7, 9, 9))  # (11, 40) ends the history: 77 banned
    sp = SamplingParams(bad_words=words)
    hf = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=EOS)
    want = hf(torch.tensor([PROMPT + OUTPUT]), logits[None].clone())[0]
    got = _row(logits, sp, PROMPT, OUTPUT)
    assert torch.equal(got, want)
    assert got[77] == -torch.inf and got[13] == -torch.inf and got[12] != -torch.inf


def test_frequency_and_presence_penalties_are_openais(logits: torch.Tensor) -> None:
    """OpenAI's formula, over the output only: mu - c * frequency - (c > 0) * presence."""
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=1.25)
    got = _row(logits, sp, PROMPT, OUTPUT)
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=V).float()
    want = logits - counts * 0.5 - (counts > 0).float() * 1.25
    torch.testing.assert_close(got, want)
    assert got[5] == logits[5]  # a prompt-only token is not penalized


def test_min_tokens_holds_back_stop_tokens(logits: torch.Tensor) -> None:
    sp = SamplingParams(min_tokens=7, stop_token_ids=(30,), max_tokens=20)
    ctx = LogitsContext(sp, np.asarray(PROMPT, np.int32), np.asarray(OUTPUT, np.int32), (EOS, 30))
    root = CandidateTree.root_only(0)
    got = process_rows(logits[None], root.parents, root.tokens, ctx)[0]
    assert got[EOS] == -torch.inf and got[30] == -torch.inf  # 5 < 7 tokens out
    ctx = LogitsContext(sp, ctx.prompt, np.asarray([*OUTPUT, 1, 1], np.int32), (EOS, 30))
    assert torch.equal(process_rows(logits[None], root.parents, root.tokens, ctx)[0], logits)


def test_allowed_token_ids(logits: torch.Tensor) -> None:
    got = _row(logits, SamplingParams(allowed_token_ids=(4, 9, 100)), PROMPT, OUTPUT)
    assert torch.isfinite(got).nonzero().flatten().tolist() == [4, 9, 100]


def test_min_p_is_hugging_faces(logits: torch.Tensor) -> None:
    """After temperature, tokens below min_p x the top probability are dropped."""
    sps = [SamplingParams(temperature=t, min_p=m) for t, m in ((1.0, 0.05), (0.7, 0.2))]
    rows = torch.stack([logits, logits.flip(0)])
    got = filtered_probs(rows, *row_params(sps, [1, 1], rows.device), row_min_p(sps, [1, 1], "cpu"))
    for i, sp in enumerate(sps):
        warped = MinPLogitsWarper(sp.min_p)(None, (rows[i : i + 1] / sp.temperature))
        want = torch.softmax(warped, dim=-1)[0]
        torch.testing.assert_close(got[i], want)


def test_tree_rows_are_processed_from_their_own_history() -> None:
    """Every row of a tree gets exactly what plain decoding gives that position: the
    processors applied to the committed output plus the node's path."""
    rng = np.random.default_rng(5)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 6])
    tokens = np.array([99, 11, 12, 11, 40, 77, 11, 9])
    logits = torch.randn(len(parents), V, generator=torch.Generator().manual_seed(1)) * 3
    sp = SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=-0.6,
        logit_bias=((11, 2.0), (40, -3.0)),
        bad_words=((11, 40, 77), (11, 11, 11)),
        min_tokens=8,
        max_tokens=30,
    )
    prompt, output = rng.integers(0, V, 9).tolist(), [11, 40, 5, 5, 11]
    tree = process_rows(logits, parents, tokens, _ctx(sp, prompt, output))
    for v, path in enumerate(path_tokens(parents, tokens)):
        alone = _row(logits[v], sp, prompt, output + path)
        assert torch.equal(tree[v], alone), v


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 5
    lp = token_logprobs(logits, np.array([4, 9, 200]), 5)
    ref = torch.log_softmax(logits, dim=-1)
    np.testing.assert_allclose(lp.logprobs, ref[[0, 1, 2], [4, 9, 200]].numpy(), rtol=1e-6)
    top = ref.topk(5, dim=-1)
    np.testing.assert_array_equal(lp.top_ids, top.indices.numpy())
    np.testing.assert_allclose(lp.top_logprobs, top.values.numpy(), rtol=1e-6)
    assert token_logprobs(logits, np.array([1, 2, 3]), 0).top_ids.shape == (3, 0)


# ---- the engine: speculation changes nothing, greedy is HF generate's -------------------


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("proc-target"), "llama", seed=0)


@pytest.fixture(scope="module")
def noisy_dir(target_dir, tmp_path_factory):
    """The target with noise on its weights: a drafter that agrees often but not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("proc-noisy")
    for f in target_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(11)
    for f in out.glob("*.safetensors"):
        state = load_file(f)
        save_file(
            {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()},
            f,
            metadata={"format": "pt"},
        )
    return out


def engine_for(target_dir, drafter_dir=None, eos: tuple[int, ...] = (EOS,)) -> Engine:
    settings = load_settings(
        None,
        engine={"kv_blocks": 512, "kv_block_size": 16, "max_queue": 64},
        scheduler={"budget": 16, "adaptive": {"d_min": 3, "d_max": 4, "w_max": 2}},
    )
    runner = load_runner(target_dir, device="cpu", dtype="float32", kv_blocks=512)
    drafter = None
    if drafter_dir is not None:
        drafter = BeamDrafter(load_runner(drafter_dir, device="cpu", dtype="float32"))
    return Engine(
        RunnerTarget(runner, eos_token_ids=eos),
        drafter,
        LocalScheduler(settings.scheduler),
        settings,
    )


PROMPTS = [[1, 5, 9, 200, 31], [7, 7, 7], [3, 3, 3, 3, 3, 3, 3, 3, 40, 41], [100, 101, 102]]
CASES = {
    "repetition": dict(repetition_penalty=1.5),
    "freq+presence": dict(frequency_penalty=0.8, presence_penalty=0.5),
    "bias+bad": dict(logit_bias=((17, 3.0), (44, -5.0)), bad_words=((5, 9), (31,))),
    "min_tokens": dict(min_tokens=20, logit_bias=((EOS, 8.0),)),
    "allowed": dict(allowed_token_ids=tuple(range(0, 256, 3))),
}


def run(engine: Engine, sps: list[SamplingParams]) -> dict:
    streams = [
        engine.submit(GenerationRequest(f"r{i}", tuple(PROMPTS[i % 4]), sp, tpot_slo_ms=5.0))
        for i, sp in enumerate(sps)
    ]
    out = run_to_completion(engine, streams)
    assert engine.target.kv_usage() == 0.0
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_speculation_changes_nothing_greedy_or_seeded(target_dir, noisy_dir, case) -> None:
    base = CASES[case]
    sps = [SamplingParams(max_tokens=24, **base) for _ in range(2)]
    sps += [
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=40 + i, min_p=0.02, **base)
        for i in range(2)
    ]
    plain = run(engine_for(target_dir), sps)
    for drafter in (target_dir, noisy_dir):
        engine = engine_for(target_dir, drafter)
        accepted = metrics.spec_num_accepted_tokens._value.get()
        assert run(engine, sps) == plain, drafter
        assert metrics.spec_num_accepted_tokens._value.get() > accepted  # it did speculate
    if case == "min_tokens":  # eos is pushed up, yet nothing ends before 20 tokens
        assert all(len(t) >= 20 for t in plain["tokens"].values())


def hf_generate(model_dir, prompt: list[int], n: int, **kw) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=0,
        **kw,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_with_processors_is_hugging_face_generate(target_dir) -> None:
    """HF generate's own processors (repetition penalty, bad words, sequence bias as
    logit_bias, min_new_tokens), greedy, against the speculative engine."""
    hf_kw = dict(
        repetition_penalty=1.4,
        bad_words_ids=[[5, 9], [31]],
        sequence_bias={(17,): 3.0, (EOS,): 6.0},
        min_new_tokens=12,
    )
    sp = SamplingParams(
        max_tokens=30,
        repetition_penalty=1.4,
        bad_words=((5, 9), (31,)),
        logit_bias=((17, 3.0), (EOS, 6.0)),
        min_tokens=12,
    )
    engine = engine_for(target_dir, target_dir)
    got = run(engine, [sp] * 4)["tokens"]
    for i in range(4):
        want = hf_generate(target_dir, PROMPTS[i], 30, **hf_kw)
        assert got[f"r{i}"] == want, i


def test_logprobs_are_plain_decodings_and_hugging_faces(target_dir, noisy_dir) -> None:
    """With speculation, each emitted token's log-probability (and the top 5) is what
    plain decoding reports, and HF's log_softmax at that position."""
    from transformers import AutoModelForCausalLM

    sps = [SamplingParams(max_tokens=16, logprobs=5)] * 2
    sps += [SamplingParams(max_tokens=16, logprobs=3, temperature=1.0, seed=5, top_k=20)]
    got = {}
    for drafter in (None, noisy_dir):
        engine = engine_for(target_dir, drafter)
        streams = [
            engine.submit(GenerationRequest(f"r{i}", tuple(PROMPTS[i]), sp, tpot_slo_ms=5.0))
            for i, sp in enumerate(sps)
        ]
        deltas: dict[str, list] = {s.request_id: [] for s in streams}
        for _ in range(400):
            engine.step()
            for s in streams:
                while (d := s.get(timeout=0)) is not None:
                    deltas[s.request_id].append(d)
            if all(d and d[-1].finish_reason for d in deltas.values()):
                break
        got[drafter] = deltas
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for rid, plain in got[None].items():
        spec = got[noisy_dir][rid]
        tokens = [t for d in plain for t in d.token_ids]
        assert tokens == [t for d in spec for t in d.token_ids]
        lp_plain = np.concatenate([d.logprobs.logprobs for d in plain if d.token_ids])
        lp_spec = np.concatenate([d.logprobs.logprobs for d in spec if d.token_ids])
        top_plain = np.concatenate([d.logprobs.top_ids for d in plain if d.token_ids])
        top_spec = np.concatenate([d.logprobs.top_ids for d in spec if d.token_ids])
        np.testing.assert_allclose(lp_spec, lp_plain, atol=1e-5)
        np.testing.assert_array_equal(top_spec, top_plain)
        prompt = PROMPTS[int(rid[1:])]
        with torch.no_grad():
            hf = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(hf, dim=-1)
        np.testing.assert_allclose(lp_spec, ref[range(len(tokens)), tokens].numpy(), atol=1e-4)
        k = top_spec.shape[1]
        np.testing.assert_array_equal(top_spec, ref.topk(k, dim=-1).indices.numpy())
