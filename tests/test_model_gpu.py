"""The runner on a CUDA device: fp32 matches transformers on the same device, tree
attention matches the CPU reference, bf16 stays close (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.model.loader import load_runner
from adaserve.model.runner import SeqInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
KV = {"kv_blocks": 64, "kv_block_size": 16}


def _script(runner) -> torch.Tensor:
    rng = np.random.default_rng(0)
    out = []
    for sid, n in (("a", 37), ("b", 5)):
        runner.add_sequence(sid)
        out.append(runner.forward([SeqInput.chain(sid, rng.integers(0, 256, n))]))
        runner.commit(sid, range(n))
    trees = [
        SeqInput(
            "a", rng.integers(0, 256, 6).astype(np.int32), np.array([-1, 0, 0, 1, 2, 3], np.int32)
        ),
        SeqInput("b", rng.integers(0, 256, 3).astype(np.int32), np.array([-1, 0, 0], np.int32)),
    ]
    out.append(runner.forward(trees))
    runner.commit("a", [0, 2, 4])
    runner.commit("b", [0, 1])
    out.append(runner.forward([SeqInput.chain("a", [5]), SeqInput.chain("b", [6])]))
    return torch.cat(out).cpu()


def test_cuda_fp32_matches_cpu_reference(tiny_llama3_dir: Path) -> None:
    cpu = _script(load_runner(tiny_llama3_dir, "cpu", "float32", **KV))
    gpu = _script(load_runner(tiny_llama3_dir, "cuda", "float32", **KV))
    torch.testing.assert_close(gpu, cpu, atol=1e-4, rtol=0)


def test_cuda_fp32_matches_transformers(tiny_qwen2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, local_files_only=True)
    hf = hf.to("cuda").eval()
    ids = np.random.default_rng(1).integers(0, 256, 50)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, device="cuda")[None]).logits[0].float().cpu()
    runner = load_runner(tiny_qwen2_dir, "cuda", "float32", **KV)
    runner.add_sequence("s")
    got = runner.forward([SeqInput.chain("s", ids)])
    assert got.device.type == "cuda" and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_close(tiny_llama_dir: Path, dtype: str) -> None:
    cpu = _script(load_runner(tiny_llama_dir, "cpu", "float32", **KV))
    runner = load_runner(tiny_llama_dir, "cuda", dtype, **KV)
    assert runner.dtype == getattr(torch, dtype)
    got = _script(runner)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, cpu, atol=0.25, rtol=0.05)
    agree = (got.argmax(-1) == cpu.argmax(-1)).float().mean().item()
    assert agree > 0.9
