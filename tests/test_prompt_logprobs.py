"""Prompt logprobs in the engine (vLLM's prompt_logprobs; completions' echo with
logprobs): scored during the prompt's prefill chunks, equal to Hugging Face's
log-softmax of the same model at the same positions, whatever the chunk size, the
prefix cache or speculation. The gateway's side is in test_openai_features.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.engine.prepare import preempt
from adaserve.engine.recovery import resync
from adaserve.request import GenerationRequest, SamplingParams, TokenLogprobs
from tests._engine import make_engine

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(45)]  # 45 tokens: several chunks


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("plp-target"), "llama", seed=0)


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> np.ndarray:
    """float32 [P - 1, V]: row i is log p(. | prompt[: i + 1]), which scores prompt[i + 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1).numpy()


def _request(rid: str, k: int | None, max_tokens: int = 4, **sp) -> GenerationRequest:
    return GenerationRequest(
        id=rid,
        prompt_token_ids=tuple(PROMPT),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k, **sp),
        tpot_slo_ms=1000.0,
    )


def _run(engine, reqs: list[GenerationRequest]) -> dict[str, tuple[list[int], TokenLogprobs]]:
    """Each request to completion, one after the other (the later ones meet the cache
    the earlier ones filled): its tokens and its prompt logprobs."""
    out = {}
    for r in reqs:
        stream = engine.submit(r)
        tokens: list[int] = []
        prompt_lp = None
        for _ in range(500):
            engine.step()
            while (d := stream.get(timeout=0)) is not None:
                assert d.error is None, d.error
                tokens += d.token_ids
                if d.prompt_logprobs is not None:
                    assert prompt_lp is None, "sent once"
                    assert d.num_generated == len(d.token_ids), "with the first token"
                    prompt_lp = d.prompt_logprobs
                if d.finish_reason is not None:
                    break
            else:
                continue
            break
        out[r.id] = (tokens, prompt_lp)
    return out


def _check(lp: TokenLogprobs | None, ref: np.ndarray, k: int) -> None:
    assert lp is not None
    n = len(PROMPT) - 1
    assert lp.logprobs.shape == (n,) and lp.top_ids.shape == (n, k)
    chosen = ref[np.arange(n), PROMPT[1:]]
    np.testing.assert_allclose(lp.logprobs, chosen, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(lp.top_logprobs, -np.sort(-ref, axis=1)[:, :k], atol=2e-5)
    # The top ids are the reference's (ties aside: random logits have none).
    np.testing.assert_array_equal(lp.top_ids, np.argsort(-ref, axis=1, kind="stable")[:, :k])
    assert lp.ranks is not None
    np.testing.assert_array_equal(lp.ranks, (ref > chosen[:, None]).sum(axis=1) + 1)


@pytest.mark.parametrize("chunk", [8, 512], ids=["chunked", "whole"])
def test_prompt_logprobs_are_hugging_faces_with_chunks_and_the_prefix_cache(
    target_dir, chunk: int
) -> None:
    """A plain request fills the prefix cache; the next ones with prompt_logprobs (one
    after the other, the same prompt) compute their whole prompt anyway, chunk by chunk,
    and get HF's log-softmax at every position. Their outputs stay the target's."""
    engine = make_engine(
        target_dir,
        engine={"max_batch_tokens": chunk, "min_prefill_tokens": min(chunk, 8)},
    )
    chunks: list[int] = []
    forward = engine.target.forward

    def recording(trees, prefill):
        chunks.extend(len(c.tokens) for c in prefill if c.scored is not None)
        return forward(trees, prefill)

    engine.target.forward = recording
    got = _run(engine, [_request("warm", None), _request("a", 3), _request("b", 5)])
    ref = hf_prompt_logprobs(target_dir, PROMPT)
    assert got["warm"][1] is None  # not asked, not sent
    _check(got["a"][1], ref, 3)
    _check(got["b"][1], ref, 5)
    assert got["a"][0] == got["b"][0] == got["warm"][0]
    assert sum(chunks) == 2 * len(PROMPT), "both scored every prompt token, none cached"
    if chunk < len(PROMPT):
        assert max(chunks) <= chunk
    hits = engine.target.prefix_cache_stats()[1]
    assert hits == 0, "nothing was taken from the cache by the scoring requests"
    # The cache is still filled: a plain request after them takes the prompt from it.
    _run(engine, [_request("after", None)])
    assert engine.target.prefix_cache_stats()[1] > 0


def test_speculation_does_not_change_prompt_logprobs(target_dir) -> None:
    """With the target drafting for itself (drafts accepted, trees in the same forwards
    as the chunks) the prompt logprobs are those of plain decoding, and of HF."""
    ref = hf_prompt_logprobs(target_dir, PROMPT)
    outs = []
    for drafter in (target_dir, None):
        engine = make_engine(
            target_dir, drafter, engine={"max_batch_tokens": 12, "min_prefill_tokens": 4}
        )
        # Another request decodes while the scoring one is prefilled: trees ride along.
        other = engine.submit(
            GenerationRequest(
                id="other",
                prompt_token_ids=(5, 6, 7),
                sampling=SamplingParams(max_tokens=40, ignore_eos=True),
                tpot_slo_ms=1000.0,
            )
        )
        for _ in range(3):
            engine.step()
        got = _run(engine, [_request("a", 2, max_tokens=8)])
        _check(got["a"][1], ref, 2)
        outs.append(got["a"])
        engine.abort(other.request_id)
    (spec_tokens, spec_lp), (plain_tokens, plain_lp) = outs
    assert spec_tokens == plain_tokens
    # Batch shapes differ (trees beside the chunks): float noise only.
    np.testing.assert_allclose(spec_lp.logprobs, plain_lp.logprobs, atol=2e-5)


def test_a_one_token_prompt_has_no_prompt_logprobs_and_bad_k_is_refused(target_dir) -> None:
    engine = make_engine(target_dir)
    stream = engine.submit(
        GenerationRequest(
            id="one",
            prompt_token_ids=(9,),
            sampling=SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=4),
            tpot_slo_ms=1000.0,
        )
    )
    first = None
    for _ in range(20):
        engine.step()
        if (d := stream.get(timeout=0)) is not None:
            first = d
            break
    assert first is not None and first.error is None
    assert first.prompt_logprobs is not None and first.prompt_logprobs.logprobs.shape == (0,)
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]


def test_preempted_mid_prefill_the_prompt_is_scored_again_from_the_start(target_dir) -> None:
    """Preempted (or re-synced after a failed iteration) before its first token, a
    scoring request recomputes its prompt from the start, not from the prefix cache
    its first chunks filled, and sends each position's logprobs once."""
    engine = make_engine(target_dir, engine={"max_batch_tokens": 8, "min_prefill_tokens": 8})
    stream = engine.submit(_request("a", 2))
    for _ in range(3):  # a few chunks in
        engine.step()
    r = engine.pool.running["a"]
    assert 0 < r.prefilled < len(PROMPT) and r.prompt_lp
    preempt(engine, r)
    got = None
    for step in range(200):
        engine.step()
        if step == 2:  # and once more, the failed-iteration way
            r = engine.pool.running["a"]
            assert r.prefilling
            resync(engine, r)
        d = stream.get(timeout=0)
        if d is not None:
            assert d.error is None, d.error
            got = d
            break
    assert got is not None
    _check(got.prompt_logprobs, hf_prompt_logprobs(target_dir, PROMPT), 2)


def test_scored_logprobs_in_row_blocks_equal_one_pass(monkeypatch) -> None:
    from adaserve import logits_process

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g)
    tokens = torch.randint(0, 50, (37,), generator=g).numpy().astype(np.int32)
    whole = logits_process.scored_logprobs(logits, tokens, 4)
    monkeypatch.setattr(logits_process, "SCORE_ROWS", 8)
    blocks = logits_process.scored_logprobs(logits, tokens, 4)
    for a, b in zip(
        (whole.logprobs, whole.top_ids, whole.top_logprobs, whole.ranks),
        (blocks.logprobs, blocks.top_ids, blocks.top_logprobs, blocks.ranks),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    ref = torch.log_softmax(logits, dim=-1).numpy()
    np.testing.assert_allclose(whole.logprobs, ref[np.arange(37), tokens], atol=1e-6)
