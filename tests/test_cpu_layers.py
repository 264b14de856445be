"""Every decoder layer in one library call (adaserve/model/cpu_layers.py): the loader
fuses a one-rank fp32 CPU model whose whole stack is on the library, and only then;
the fused forward computes what the module-by-module one does (within float32
rounding: RoPE and SiLU are written out with their own); a position's logits are the
same bits whether its prompt went in one chunk, in several, or token by token; EAGLE's
feature taps are the residual stream the logits come from; and every build of the
library computes the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.model.cpu_layers import CpuLayers, fuse
from adaserve.model.loader import load_runner
from adaserve.model.runner import ModelRunner, SeqInput
from tests._kernels import ISAS, needs_kernel
from tests.conftest import make_tiny_model

pytestmark = needs_kernel

# head_dim 16, the smallest the library takes; 3 layers, so a layer's output feeds
# another's attention.
SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 256, 29)]


def runner_for(path, quantization: str = "none", activations: str = "float32") -> ModelRunner:
    runner = load_runner(
        path,
        "cpu",
        "float32",
        kv_blocks=64,
        kv_block_size=4,
        quantization=quantization,
        stored_activations=activations,
    )
    assert isinstance(runner, ModelRunner)
    return runner


def logits(runner: ModelRunner, chunks: list[int], sid: str = "s") -> torch.Tensor:
    """The prompt in chunks of these sizes; every row's logits."""
    runner.add_sequence(sid)
    rows, start = [], 0
    for n in chunks:
        part = PROMPT[start : start + n]
        rows.append(runner.forward([SeqInput.chain(sid, part)]))
        runner.commit(sid, list(range(len(part))))
        start += n
    runner.free(sid)
    return torch.cat(rows)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_the_fused_forward_computes_what_the_layers_do(tmp_path, kind, quantization) -> None:
    """Same weights, fused and module by module: the logits agree to float32 rounding.
    The two differ only in how RoPE and SiLU round (a few ulp of activations of size
    ~1), which 3 layers of weights of scale 0.2 (conftest) carry into logits of size
    ~10 as at most ~1e-5 absolute; 1e-4 leaves room and still catches any wrong
    wiring (a missing bias or residual, a rotated v, a swapped gate and up), which
    moves logits by O(1)."""
    path = make_tiny_model(tmp_path, kind, seed=3, **SHAPE)
    runner = runner_for(path, quantization)
    assert isinstance(runner.model.cpu_layers, CpuLayers)
    fused = logits(runner, [len(PROMPT)])
    runner.model.cpu_layers = None
    layered = logits(runner, [len(PROMPT)])
    assert fused.abs().max() > 1.0  # logits of real size, not near zero
    torch.testing.assert_close(fused, layered, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quantization,activations", [("none", "float32"), ("int4", "int8")])
def test_a_position_gets_the_same_bits_however_its_prompt_was_cut(
    tmp_path, quantization, activations
) -> None:
    """One chunk, three, or a token at a time: every position's logits bit for bit
    alike (int8 activations round each hidden state, so one ulp anywhere would show)."""
    runner = runner_for(
        make_tiny_model(tmp_path, "llama", seed=4, **SHAPE), quantization, activations
    )
    whole = logits(runner, [len(PROMPT)])
    assert torch.equal(logits(runner, [10, 13, 6]), whole)
    assert torch.equal(logits(runner, [1] * len(PROMPT)), whole)


def test_feature_taps_are_the_residual_stream_the_logits_come_from(tmp_path) -> None:
    """EAGLE reads layers' outputs: through the fused call they agree with the module
    path's, and the last layer's, normed and through the LM head, is the logits."""
    runner = runner_for(make_tiny_model(tmp_path, "llama", seed=5, **SHAPE))
    model = runner.model
    taps = [2, 0]

    def forward(sid: str) -> tuple[torch.Tensor, torch.Tensor]:
        runner.add_sequence(sid)
        out, feats = runner.forward_features([SeqInput.chain(sid, PROMPT)], taps)
        runner.free(sid)
        assert feats is not None and feats.shape == (len(PROMPT), 2 * 64)
        return out, feats

    out, feats = forward("a")
    with torch.inference_mode():
        again = model.lm_head(model.norm(feats[:, :64].contiguous())).float()
    assert torch.equal(again, out)
    layers = model.cpu_layers
    model.cpu_layers = None
    _, ref = forward("b")
    model.cpu_layers = layers
    torch.testing.assert_close(feats, ref, atol=1e-4, rtol=1e-4)  # as the logits above
    runner.add_sequence("c")
    with pytest.raises(ValueError, match="feature layers"):
        runner.forward_features([SeqInput.chain("c", PROMPT)], [3])


@pytest.mark.parametrize("isa", ISAS)
def test_every_build_of_the_library_computes_the_same(tmp_path, isa) -> None:
    """Each instruction set's build of the fused call (its linear layers, attention and
    norms included), on stored int4 blocks: the module path's logits to float32
    rounding, as above. (Not the same bits: the attention's scores sum over a build's
    vector lanes.)"""
    runner = runner_for(make_tiny_model(tmp_path, "qwen2", seed=6, **SHAPE), "int4")
    runner.model.cpu_layers = None
    layered = logits(runner, [len(PROMPT)])
    runner.model.cpu_layers = fuse(runner.model, isa)
    torch.testing.assert_close(logits(runner, [len(PROMPT)]), layered, atol=1e-4, rtol=1e-4)


def test_only_a_stack_wholly_on_the_library_is_fused(tmp_path) -> None:
    path = make_tiny_model(tmp_path, "llama", seed=7, **SHAPE)
    mkl = load_runner(path, "cpu", "float32", kv_blocks=64, cpu_kernel="mkl")
    assert isinstance(mkl, ModelRunner) and mkl.model.cpu_layers is None
    # head_dim 8: the tree attention does not take it, so nothing is fused
    small = make_tiny_model(tmp_path / "small", "llama", seed=7)
    runner = load_runner(small, "cpu", "float32", kv_blocks=64)
    assert isinstance(runner, ModelRunner) and runner.model.cpu_layers is None
