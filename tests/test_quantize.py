"""The int8 CPU drafter (adaserve/model/quantize.py): its layers are really swapped, its
logits stay close to fp32, and speculation with it still emits the target's own greedy
output, through the settings path that `adaserve up` uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve import metrics
from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.engine_build import build_drafter
from adaserve.model.cpu_gemm import PackedLinear, packed_kernel_available
from adaserve.model.loader import load_runner
from adaserve.model.quantize import Int8Linear, quantize_int8
from adaserve.model.runner import SeqInput
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
from tests._engine import PROMPTS, hf_greedy, req, run_to_completion
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("q8"), "llama", seed=0)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("q8-untied"), "llama", seed=3, tie_word_embeddings=False
    )


def _logits(runner, prompt: list[int]) -> torch.Tensor:
    runner.add_sequence("s")
    try:
        ids = np.asarray(prompt, np.int32)
        return runner.forward([SeqInput.chain("s", ids)]).float()
    finally:
        runner.free("s")


def _int8_layers(model, kernel: str) -> list:
    """fbgemm's Int8Linear on MKL; the packed kernel's int8 PackedLinear otherwise."""
    if kernel == "mkl":
        return [m for m in model.modules() if isinstance(m, Int8Linear)]
    return [m for m in model.modules() if isinstance(m, PackedLinear) and m.int8]


@pytest.mark.parametrize("kernel", ["auto", "mkl"])
@pytest.mark.parametrize("fixture,expected", [("model_dir", 8), ("untied_dir", 9)])
def test_every_linear_is_int8_and_the_logits_stay_close(request, fixture, expected, kernel):
    """2 layers x (qkv, o, gate_up, down), plus the LM head when it is not the
    embedding's own tensor; with the packed kernel ("auto") and with fbgemm ("mkl")."""
    if kernel == "auto" and not packed_kernel_available():
        pytest.skip("packed CPU kernel unavailable here")
    path = request.getfixturevalue(fixture)
    fp32 = load_runner(path, device="cpu", dtype="float32", kv_blocks=64, cpu_kernel="mkl")
    int8 = load_runner(
        path, device="cpu", dtype="float32", kv_blocks=64, quantization="int8", cpu_kernel=kernel
    )
    swapped = _int8_layers(int8.model, kernel)
    assert len(swapped) == expected
    if kernel == "mkl":
        assert not any(isinstance(m, PackedLinear) for m in int8.model.modules())
    a, b = _logits(fp32, PROMPTS[2]), _logits(int8, PROMPTS[2])
    assert not torch.equal(a, b)  # it really is another kernel
    assert (b - a).norm() / a.norm() < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_quantization_is_refused_where_it_cannot_run(model_dir):
    # MKL layers: the packed CPU kernel (cpu_gemm.py) would have replaced them
    runner = load_runner(model_dir, device="cpu", dtype="float32", kv_blocks=64, cpu_kernel="mkl")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        load_runner(model_dir, device="cpu", dtype="float32", kv_blocks=64, quantization="int3")
    runner.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        quantize_int8(runner.model)


def test_speculation_with_an_int8_drafter_is_lossless(model_dir):
    """Self-drafting, but the drafter is the int8 copy: its trees differ from the
    target's choices now and then, and every emitted token is still the target's."""
    settings = load_settings(
        None,
        model={"drafter": str(model_dir), "drafter_quantization": "int8", "device": "cpu"},
        engine={"kv_blocks": 512, "kv_block_size": 16, "max_queue": 64},
        # equal shares: every request verifies its share of the tree whatever the node
        # probabilities (adaserve's policy would skip this random model's weak nodes)
        scheduler={"budget": 12, "policy": "equal"},
    )
    drafter = build_drafter(settings)
    kernel = "auto" if packed_kernel_available() else "mkl"
    assert _int8_layers(drafter.runner.model, kernel)
    target = load_runner(model_dir, device="cpu", dtype="float32", kv_blocks=512)
    engine = Engine(
        target=RunnerTarget(target, eos_token_ids=()),
        drafter=drafter,
        scheduler=LocalScheduler(settings.scheduler),
        settings=settings,
    )
    drafts, accepted = metrics.spec_num_drafts._value.get(), _accepted()
    streams = [engine.submit(req(i, PROMPTS[i], 24, 1e4)) for i in range(4)]
    res = run_to_completion(engine, streams)
    for i in range(4):
        assert res["tokens"][f"r{i}"] == hf_greedy(model_dir, PROMPTS[i], 24)
    # its trees were verified, and the target took some of their tokens
    assert engine.stats().drafter_healthy
    assert metrics.spec_num_drafts._value.get() > drafts and _accepted() > accepted


def _accepted() -> float:
    return metrics.spec_num_accepted_tokens._value.get()
