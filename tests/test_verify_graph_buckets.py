"""The verifier's CUDA-graph shapes on CPU, eagerly (issue 23): which (batch, tokens)
buckets are captured, which bucket a forward pads to, that prefill iterations run
eagerly, and that a forward padded to its bucket gives the real rows the logits and
KV of the unpadded forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.model.cuda_graphs import (
    DEFAULT_VERIFY_BATCH_BUCKETS,
    DEFAULT_VERIFY_TOKEN_BUCKETS,
    PAD_SEQ,
    VerifyBucket,
    pad_forward_batch,
    pick_verify_bucket,
    reserve_pad_slot,
    verify_capture_keys,
)
from adaserve.model.loader import load_runner
from adaserve.model.runner import ModelRunner, SeqInput

B = (1, 2, 4, 8)
T = (4, 8, 16, 32)


def test_capture_keys_largest_first_and_feasible() -> None:
    keys = verify_capture_keys(B, T)
    assert keys == sorted(keys, reverse=True)
    assert keys[0] == VerifyBucket(tokens=32, batch=8)
    assert all(k.tokens >= k.batch for k in keys)
    assert VerifyBucket(tokens=4, batch=8) not in keys  # 8 sequences need 8 tokens
    assert len(keys) == len(set(keys)) == 4 + 4 + 4 + 3
    assert max(k.tokens for k in verify_capture_keys(B, T, max_batch_tokens=16)) == 16
    defaults = verify_capture_keys()
    assert defaults[0] == VerifyBucket(
        tokens=DEFAULT_VERIFY_TOKEN_BUCKETS[-1], batch=DEFAULT_VERIFY_BATCH_BUCKETS[-1]
    )


@pytest.mark.parametrize(
    ("lens", "want"),
    [
        ([4], VerifyBucket(tokens=4, batch=1)),  # exact: no padding
        ([3], VerifyBucket(tokens=4, batch=2)),  # a dummy sequence holds the padding token
        ([5, 3], VerifyBucket(tokens=8, batch=2)),
        ([2, 2], VerifyBucket(tokens=4, batch=2)),
        ([1, 1, 1], VerifyBucket(tokens=4, batch=4)),
        ([1] * 8, VerifyBucket(tokens=8, batch=8)),
        ([1] * 5, VerifyBucket(tokens=8, batch=8)),
        ([2, 3], VerifyBucket(tokens=8, batch=4)),  # 5 -> 8 tokens: a dummy holds 3
        ([1] * 9, None),  # more sequences than the largest batch bucket
        ([20, 13], None),  # 33 tokens: above the largest token bucket
    ],
)
def test_pick_verify_bucket(lens: list[int], want: VerifyBucket | None) -> None:
    got = pick_verify_bucket(lens, [False] * len(lens), B, T)
    assert got == want
    if got is not None:  # the bucket fits: enough sequences and tokens, >= 1 per dummy
        assert got.batch >= len(lens) and got.tokens >= sum(lens)
        assert got.tokens - sum(lens) >= got.batch - len(lens)
        assert got.tokens == sum(lens) or got.batch > len(lens)


def test_prefill_iterations_run_eager() -> None:
    assert pick_verify_bucket([3, 1], [False, True], B, T) is None
    assert pick_verify_bucket([3, 1], [False, False], B, T) is not None
    assert pick_verify_bucket([3, 1], [], B, T) is not None  # no flags: no prompt chunk


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    r = load_runner(tiny_llama_dir, device="cpu", kv_blocks=64, kv_block_size=4)
    assert isinstance(r, ModelRunner)
    return r


def _trees(runner: ModelRunner, rng: np.random.Generator, sizes: list[int], tag: str):
    """Sequences with committed prompts of different lengths and a random tree each."""
    inputs = []
    for i, k in enumerate(sizes):
        sid = f"{tag}{i}"
        runner.add_sequence(sid)
        prompt = rng.integers(0, runner.vocab_size, 3 + 5 * i).astype(np.int32)
        runner.forward([SeqInput.chain(sid, prompt, prefill=True)], last_only=True)
        runner.commit(sid, range(len(prompt)))
        parents = np.array([-1] + [int(rng.integers(0, j)) for j in range(1, k)], np.int32)
        inputs.append(
            SeqInput(sid, rng.integers(0, runner.vocab_size, k).astype(np.int32), parents)
        )
    return inputs


@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto: the packed CPU kernel's
@pytest.mark.parametrize("sizes", [[3], [5, 1, 2], [1, 1, 1, 1, 1]])
def test_padding_to_the_bucket_keeps_the_real_rows(tiny_llama_dir, backend, sizes) -> None:
    runner = load_runner(
        tiny_llama_dir, device="cpu", kv_blocks=64, kv_block_size=4, attention_backend=backend
    )
    assert isinstance(runner, ModelRunner)
    pad_slot = reserve_pad_slot(runner.cache)
    assert reserve_pad_slot(runner.cache) == pad_slot  # one pad sequence per cache
    rng = np.random.default_rng(len(sizes))
    fb = runner.prepare(_trees(runner, rng, sizes, "s"))
    bucket = pick_verify_bucket(fb.attention.query_lens, fb.attention.prefill, B, T)
    assert bucket is not None
    padded = pad_forward_batch(fb, bucket, pad_slot, runner.block_size)
    t = sum(sizes)
    assert len(padded.ids) == bucket.tokens and len(padded.attention.query_lens) == bucket.batch

    storage = runner.cache.storage.kv
    unpadded = runner.execute(fb)
    kv_unpadded = storage.clone()
    got = runner.execute(padded)
    assert got.shape[0] == bucket.tokens
    torch.testing.assert_close(got[:t], unpadded, atol=2e-5, rtol=1e-5)
    assert torch.equal(got[:t].argmax(-1), unpadded.argmax(-1))
    # The dummies wrote only the pad slot; every other slot holds the unpadded KV (up to
    # the rounding of a GEMM over more rows).
    keep = torch.ones(storage.shape[1], dtype=torch.bool)
    keep[pad_slot] = False
    # equal_nan: slots no sequence ever wrote hold whatever torch.empty left there.
    torch.testing.assert_close(
        storage[:, keep], kv_unpadded[:, keep], atol=2e-5, rtol=1e-5, equal_nan=True
    )
    assert not torch.equal(storage[:, pad_slot], kv_unpadded[:, pad_slot])


def test_padding_keeps_selected_logit_rows(runner: ModelRunner) -> None:
    rng = np.random.default_rng(3)
    fb = runner.prepare(_trees(runner, rng, [2, 3], "r"), last_only=True)
    bucket = pick_verify_bucket(fb.attention.query_lens, fb.attention.prefill, B, T)
    assert bucket == VerifyBucket(tokens=8, batch=4)
    padded = pad_forward_batch(fb, bucket, reserve_pad_slot(runner.cache), runner.block_size)
    torch.testing.assert_close(runner.execute(padded), runner.execute(fb), atol=2e-5, rtol=1e-5)


def test_pad_forward_batch_refuses_a_bucket_that_does_not_fit(runner: ModelRunner) -> None:
    fb = runner.prepare(_trees(runner, np.random.default_rng(4), [3, 3], "q"))
    slot = reserve_pad_slot(runner.cache)
    with pytest.raises(ValueError, match="do not fit"):
        pad_forward_batch(fb, VerifyBucket(tokens=8, batch=2), slot, runner.block_size)
    with pytest.raises(ValueError, match="do not fit"):
        pad_forward_batch(fb, VerifyBucket(tokens=4, batch=4), slot, runner.block_size)
    assert pad_forward_batch(fb, VerifyBucket(tokens=6, batch=2), slot, 4) is fb
    assert PAD_SEQ in runner.cache.seqs
