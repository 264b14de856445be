import numpy as np
import pytest
import torch

from adaserve import sampling
from adaserve.request import GenerationRequest, SamplingParams, TokenDelta
from tests._stats import chi_square_pvalue


def _rows(n: int, temp, top_k, top_p):
    return (
        torch.tensor(temp, dtype=torch.float32),
        torch.tensor(top_k, dtype=torch.int64),
        torch.tensor(top_p, dtype=torch.float32),
    )


def test_temperature_scales_logits():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    probs = sampling.filtered_probs(logits, *_rows(3, [1.0, 0.5, 2.0], [0] * 3, [1.0] * 3))
    for i, t in enumerate([1.0, 0.5, 2.0]):
        torch.testing.assert_close(probs[i], torch.softmax(logits[i] / t, -1))


def test_greedy_row_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    probs = sampling.filtered_probs(logits, *_rows(1, [0.0], [2], [0.5]))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0]])
    probs = sampling.filtered_probs(logits, *_rows(1, [1.0], [2], [1.0]))
    expected = torch.zeros(5)
    expected[[1, 3]] = torch.softmax(torch.tensor([5.0, 4.0]), -1)
    torch.testing.assert_close(probs[0], expected)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = torch.tensor([[0.05, 0.5, 0.1, 0.3, 0.05]])
    logits = p.log()
    # Sorted: 0.5, 0.3, 0.1, ... -> 0.8 reaches top_p=0.75 after two tokens.
    probs = sampling.filtered_probs(logits, *_rows(1, [1.0], [0], [0.75]))
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.625, 0.0, 0.375, 0.0]))
    # top_p smaller than the best token's mass still keeps that token.
    probs = sampling.filtered_probs(logits, *_rows(1, [1.0], [0], [0.01]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    # Just past the two-token mass, the third token is needed.
    probs = sampling.filtered_probs(logits, *_rows(1, [1.0], [0], [0.81]))
    assert (probs[0] > 0).tolist() == [False, True, True, True, False]


def test_batched_rows_equal_rows_alone():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 50, generator=g)
    temp, top_k, top_p = [0.7, 0.0, 1.3, 1.0, 0.9], [0, 3, 10, 0, 5], [0.9, 1.0, 0.5, 1.0, 0.95]
    batched = sampling.filtered_probs(logits, *_rows(5, temp, top_k, top_p))
    for i in range(5):
        alone = sampling.filtered_probs(
            logits[i : i + 1], *_rows(1, [temp[i]], [top_k[i]], [top_p[i]])
        )
        torch.testing.assert_close(batched[i], alone[0])
    torch.testing.assert_close(batched.sum(-1), torch.ones(5))


def test_inputs_not_modified():
    logits = torch.randn(2, 9)
    before = logits.clone()
    sampling.filtered_probs(logits, *_rows(2, [0.5, 0.0], [3, 0], [0.8, 1.0]))
    assert torch.equal(logits, before)


def test_inverse_cdf_never_picks_impossible_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = np.array([0.0, 0.4999, 0.5, 1.0 - 2**-53])
    assert sampling.sample_from_probs(probs, u).tolist() == [1, 1, 3, 3]


def test_uniforms_deterministic_and_uniform():
    keys = np.repeat(np.arange(50, dtype=np.uint64), 400)
    pos = np.tile(np.arange(400), 50)
    u = sampling.uniforms(keys, pos)
    assert np.array_equal(u, sampling.uniforms(keys, pos))
    assert u.min() >= 0.0 and u.max() < 1.0
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert chi_square_pvalue(counts, np.full(20, 0.05)) > 1e-3
    # Neighbouring keys and positions are decorrelated.
    a = sampling.uniforms(np.zeros(5000, np.uint64), np.arange(5000))
    b = sampling.uniforms(np.ones(5000, np.uint64), np.arange(5000))
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.05
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.05


def test_sampled_distribution_matches_filtered_probs():
    logits = torch.tensor([[0.3, -1.0, 2.0, 0.0, 1.1, -0.5, 0.7, 0.2]])
    sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    n = 20000
    probs = sampling.filtered_probs(logits, *sampling.row_params([sp], [1], logits.device))
    u = sampling.uniforms(np.full(n, 12345, np.uint64), np.arange(n))
    draws = sampling.sample_from_probs(probs.expand(n, -1), u).numpy()
    counts = np.bincount(draws, minlength=8)
    assert chi_square_pvalue(counts, probs[0].numpy()) > 1e-3


def test_seeded_sample_is_independent_of_batch_composition():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 100, generator=g)
    sps = [SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 9, 10)]
    keys = [sampling.request_key(sp.seed) for sp in sps]
    batch = sampling.sample(logits, sps, keys, [3, 3, 3, 3])
    for i in range(4):
        alone = sampling.sample(logits[i : i + 1], [sps[i]], [keys[i]], [3])
        assert int(alone[0]) == int(batch[i])
    # Reordering the batch changes nothing either.
    rev = sampling.sample(logits.flip(0), sps[::-1], keys[::-1], [3] * 4)
    assert rev.flip(0).tolist() == batch.tolist()


def test_token_rng_positions():
    rng = sampling.TokenRng(seed=5)
    first = rng.at(np.arange(3))
    rng.advance(2)
    assert rng.position == 2
    assert rng.at(np.arange(1))[0] == first[2]
    assert sampling.TokenRng(seed=5).key == 5 and sampling.request_key(-1) == 2**64 - 1
    assert sampling.TokenRng().key != sampling.TokenRng().key


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_request_values():
    sp = SamplingParams(stop=["a"], stop_token_ids=[3])  # JSON lists become tuples
    assert sp.stop == ("a",) and sp.stop_token_ids == (3,) and hash(sp)
    req = GenerationRequest("r1", [1, 2], sp, tpot_slo_ms=50.0)
    assert req.prompt_token_ids == (1, 2)
    with pytest.raises(ValueError, match="empty prompt"):
        GenerationRequest("r1", (), sp, tpot_slo_ms=50.0)
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        GenerationRequest("r1", (1,), sp, tpot_slo_ms=0.0)
    with pytest.raises(ValueError, match="finish_reason"):
        TokenDelta((1,), "x", "done", 1, 1)
