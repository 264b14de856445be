"""The packed few-row CPU kernel (adaserve/model/cpu_gemm.py): it computes x W^T (+ b)
for any rows, columns and features, a row's result does not depend on the rows beside
it, the loader really swaps every fp32 linear layer (a tied embedding reads the head's
packed weights), the model's logits stay those of MKL within float32 rounding, and
speculation on it still emits the Hugging Face model's own greedy output. The AVX-512
and AVX2 builds are each checked where the CPU runs them, and give the same bits.
Where the kernel cannot be built the model stays on MKL."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from adaserve.config import load_settings
from adaserve.model import cpu_gemm
from adaserve.model.cpu_gemm import KernelUnavailable, PackedEmbedding, PackedLinear, pack_linears
from adaserve.model.loader import load_runner
from tests._engine import PROMPTS, hf_greedy, make_engine, req, run_to_completion
from tests._kernels import ISAS, RUNNABLE, WHY, logits_of, needs_kernel
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 8, 9, 11, 17, 64])
@pytest.mark.parametrize(
    "out_features,in_features", [(1, 7), (31, 64), (32, 1), (33, 96), (200, 576)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_matmul(isa, rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    y = PackedLinear(w.t().contiguous(), b, isa=isa)(x)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weights_match_their_dequantized_matmul(isa, rows, bias):
    """int8 per output feature, activations kept float32: exactly x (q * scale)^T + b
    up to float32 rounding, and within int8 rounding of the float weights."""
    g = torch.Generator().manual_seed(rows)
    w_t = torch.randn(96, 70, generator=g)  # [in, out]
    b = torch.randn(70, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    layer = PackedLinear(w_t, b, int8=True, isa=isa)
    assert layer.packed.dtype == torch.int8
    q, scale = cpu_gemm.quantize_columns(w_t)
    ref = x.double() @ (q.double() * scale.double()) + (0 if b is None else b.double())
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-4)
    exact = x @ w_t + (0 if b is None else b)
    assert (layer(x) - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_is_bitwise_the_same_whatever_rows_are_beside_it(isa):
    """The lossless argument on the CPU: the logits of a tree node are the ones a plain
    decode step of that token would get, however many nodes are verified with it."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(576, 1000, generator=g), torch.randn(1000, generator=g)
    layer = PackedLinear(w, b, isa=isa)
    x = torch.randn(20, 576, generator=g)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(20)])
    for m in (2, 4, 5, 6, 8, 9, 10, 11, 16, 20):
        assert torch.equal(layer(x[:m]), alone[:m]), m


@pytest.mark.skipif(len(RUNNABLE) < 2, reason="needs a CPU that runs both builds (AVX-512)")
@pytest.mark.parametrize("int8", [False, True])
def test_every_build_gives_the_avx2_builds_bits(int8):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(576, 300, generator=g), torch.randn(300, generator=g)
    x = torch.randn(13, 576, generator=g)
    narrow = PackedLinear(w, b, int8=int8, isa="avx2")(x)
    for isa in RUNNABLE[:-1]:  # avx512, and avx512vnni where the CPU has VNNI
        assert torch.equal(PackedLinear(w, b, int8=int8, isa=isa)(x), narrow), isa


def test_a_build_the_cpu_does_not_run_is_refused():
    if WHY is not None:
        with pytest.raises(KernelUnavailable):
            cpu_gemm.supported_isas()
        return
    assert cpu_gemm.supported_isas()[-1] == "avx2"  # every x86-64 build here runs AVX2
    missing = [isa for isa in cpu_gemm.ISA_FLAGS if isa not in RUNNABLE]
    for isa in missing:
        with pytest.raises(KernelUnavailable, match=isa):
            cpu_gemm.kernel(isa)


@needs_kernel
def test_non_contiguous_input_and_bad_shapes():
    layer = PackedLinear(torch.randn(40, 64), None)  # [in, out]
    x = torch.randn(40, 3).t()  # [3, 40], not contiguous
    torch.testing.assert_close(layer(x), x @ layer_weight(layer), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        layer(torch.randn(3, 41))
    with pytest.raises(ValueError, match="float32"):
        layer(torch.randn(3, 64, dtype=torch.float64))


def layer_weight(layer: PackedLinear) -> torch.Tensor:
    """The [in, out] weight back out of the packed blocks."""
    blocks, k, width = layer.packed.shape
    return layer.packed.permute(1, 0, 2).reshape(k, blocks * width)[:, : layer.out_features]


@needs_kernel
@pytest.mark.parametrize(
    "kind,tied,expected", [("llama", True, 9), ("llama", False, 9), ("qwen2", True, 9)]
)
def test_loader_packs_every_linear_and_logits_match_mkl(tmp_path, kind, tied, expected):
    """2 layers x (qkv, o, gate_up, down) + the LM head; qwen2 has qkv biases."""
    path = make_tiny_model(tmp_path, kind, seed=4, tie_word_embeddings=tied)
    mkl = load_runner(path, device="cpu", dtype="float32", kv_blocks=64, cpu_kernel="mkl")
    packed = load_runner(path, device="cpu", dtype="float32", kv_blocks=64)
    assert not any(isinstance(m, PackedLinear) for m in mkl.model.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == expected
    assert isinstance(packed.model.embed, PackedEmbedding) == tied
    ids = torch.tensor([0, 5, 31, 32, 33, mkl.model.embed.vocab - 1])
    torch.testing.assert_close(packed.model.embed(ids), mkl.model.embed(ids), rtol=0, atol=0)
    a, b = logits_of(mkl, PROMPTS[2]), logits_of(packed, PROMPTS[2])
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
def test_speculation_on_the_packed_kernel_is_lossless(tmp_path):
    target = make_tiny_model(tmp_path / "t", "llama", seed=0)
    drafter = make_tiny_model(tmp_path / "d", "llama", seed=1)
    engine = make_engine(target, drafter)
    assert isinstance(engine.target.runner.model.lm_head, PackedLinear)
    slos = [10.0, 150.0, 1.0, 1000.0]
    streams = [engine.submit(req(i, PROMPTS[i], 20, slos[i])) for i in range(4)]
    out = run_to_completion(engine, streams)["tokens"]
    for i in range(4):
        assert out[f"r{i}"] == hf_greedy(target, PROMPTS[i], 20), i


def test_mkl_where_the_kernel_cannot_be_built(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path / "m", "llama", seed=0)
    monkeypatch.setenv("ADASERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_gemm.kernel.cache_clear()
    try:
        with pytest.raises(KernelUnavailable):
            cpu_gemm.kernel()
        runner = load_runner(path, device="cpu", dtype="float32", kv_blocks=64)
        assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())
        assert logits_of(runner, PROMPTS[0]).isfinite().all()
    finally:
        cpu_gemm.kernel.cache_clear()


def test_unknown_kernel_is_refused(tmp_path):
    with pytest.raises(ValidationError, match="cpu_kernel"):
        load_settings(None, model={"cpu_kernel": "fast"})
    runner = load_runner(
        make_tiny_model(tmp_path, "llama", seed=0), "cpu", "float32", kv_blocks=64, cpu_kernel="mkl"
    )
    with pytest.raises(ValueError, match="unknown cpu_kernel"):
        pack_linears(runner.model, "fast")
