"""GPU backends on CUDA: the Triton tree-attention kernel (and FlashInfer where it is
installed) against the reference backend, the runner's logits with each backend, and
CUDA-graph draft steps against eager ones. Skipped without CUDA."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from adaserve.model.attention import ReferenceBackend
from adaserve.model.attention_setting import make_backend
from adaserve.model.kv_cache import KVStorage, PagedKVCache
from tests._attention_trees import random_qkv, random_tree_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 32)])
@pytest.mark.parametrize("shape", ["random", "rooted", "chain", "flat"])
def test_backend_matches_reference(backend, dtype, heads, kv_heads, head_dim, shape) -> None:
    if backend == "flashinfer" and dtype == torch.float32:
        pytest.skip("FlashInfer kernels take half types")
    dev = torch.device("cuda")
    rng = np.random.default_rng(heads + head_dim)
    storage = KVStorage(1, 1024, 16, kv_heads, head_dim, dtype, dev)
    storage.kv.normal_()
    cache = PagedKVCache(storage, 1024, 16)
    specs = [(int(rng.integers(0, 400)), int(rng.integers(1, 80))) for _ in range(7)]
    batch = random_tree_batch(cache, specs, rng, shape)
    q, kv_new = random_qkv(sum(batch.query_lens), heads, kv_heads, head_dim, dtype, dev)
    ref = ReferenceBackend(heads, kv_heads, head_dim, dev)
    want = ref.attend(0, q, kv_new, storage, ref.plan(batch))
    be = make_backend(backend, heads, kv_heads, head_dim, dev, block_size=16, dtype=dtype)
    got = be.attend(0, q, kv_new, storage, be.plan(batch))
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < (2e-3 if dtype == torch.float32 else 1e-2)


def test_runner_logits_triton_equal_reference(tiny_llama_dir) -> None:
    from adaserve.model.loader import load_runner
    from adaserve.model.runner import SeqInput

    out = {}
    for backend in ["reference", "triton"]:
        r = load_runner(tiny_llama_dir, "cuda", "float32", kv_blocks=64, attention_backend=backend)
        r.add_sequence("a")
        r.add_sequence("b")
        r.forward([SeqInput.chain("a", [1, 2, 3, 4, 5]), SeqInput.chain("b", [7, 8])])
        r.commit("a", range(5))
        r.commit("b", range(2))
        tree = SeqInput("a", np.array([9, 10, 11, 12], np.int32), np.array([-1, 0, 0, 1], np.int32))
        out[backend] = r.forward([tree, SeqInput.chain("b", [3])])
    assert rel_err(out["triton"], out["reference"]) < 2e-3


def test_graphed_draft_steps_equal_eager(tiny_llama_dir) -> None:
    from adaserve.drafter import DraftUpdate
    from adaserve.model.cuda_graphs import install_draft_graphs
    from adaserve.model.loader import load_runner
    from adaserve.speculate import BeamDrafter

    rng = np.random.default_rng(0)
    hist = [rng.integers(0, 256, int(rng.integers(3, 30))).astype(np.int32) for _ in range(6)]
    trees = {}
    for graphed in [False, True]:
        r = load_runner(
            tiny_llama_dir, "cuda", "float32", kv_blocks=256, attention_backend="triton"
        )
        wrapper = install_draft_graphs(r, widths=[2], n_buckets=[4, 8]) if graphed else None
        d = BeamDrafter(r)
        first = d.speculate([DraftUpdate(f"s{i}", h, len(h)) for i, h in enumerate(hist)], 4, 2)
        nxt = [np.array([5, 6], np.int32) for _ in hist]
        second = d.speculate(
            [
                DraftUpdate(f"s{i}", x, len(h) + 2)
                for i, (x, h) in enumerate(zip(nxt, hist, strict=True))
            ],
            4,
            2,
        )
        trees[graphed] = first + second
        if wrapper is not None:
            assert wrapper.replays == 2 * 3  # steps 2..4 of both calls; n=6 padded to 8
    for a, b in zip(trees[False], trees[True], strict=True):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-3)
