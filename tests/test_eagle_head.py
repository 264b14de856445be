"""The EAGLE head on the paged runner against a dense computation of the contract's
math, and the target's features against Hugging Face's hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from adaserve.model import draft_assets
from adaserve.model.eagle import load_eagle_runner
from adaserve.model.loader import load_runner
from adaserve.model.runner import SeqInput
from adaserve.model.weights import load_state
from tests._eagle import make_eagle_dir
from tests._stats import single_thread

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's layout: rotate_half over [n, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def dense_reference(
    head_dir: Path, target_dir: Path, tokens: list[int], g_prev: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [n, H] and logits [n, V_draft] of a chain: x_t = fc(cat(E[tok_t], g_prev[t])),
    the head's decoder layers with causal attention at positions 0..n-1."""
    cfg = json.loads((head_dir / "config.json").read_text())
    state = load_state(head_dir)
    if cfg["adaserve_weight_format"] == "int8_rowwise":
        state = draft_assets.dequantize(state)
    state = {k: v.float() for k, v in state.items()}
    emb = draft_assets.target_embedding(target_dir)
    d2t = load_file(str(head_dir / "draft_vocab.safetensors"))["d2t"]
    eps, heads, kv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = cfg["rope_parameters"]["rope_theta"]
    d = cfg["head_dim"]
    n = len(tokens)
    pos = torch.arange(n)
    x = torch.cat([emb[torch.tensor(tokens)], g_prev.float()], -1)
    x = F.linear(x, state["eagle.fc.weight"], state.get("eagle.fc.bias"))
    for k in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{k}."
        xn = _rms(x, state[p + "input_layernorm.weight"], eps)
        q = (xn @ state[p + "self_attn.q_proj.weight"].T).view(n, heads, d)
        kk = (xn @ state[p + "self_attn.k_proj.weight"].T).view(n, kv, d)
        v = (xn @ state[p + "self_attn.v_proj.weight"].T).view(n, kv, d)
        q, kk = _rope(q, pos, theta), _rope(kk, pos, theta)
        rep = heads // kv
        kk, v = kk.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = torch.einsum("qhd,khd->hqk", q, kk) / d**0.5
        att = att.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, heads * d)
        x = x + o @ state[p + "self_attn.o_proj.weight"].T
        xn = _rms(x, state[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(xn @ state[p + "mlp.gate_proj.weight"].T) * (
            xn @ state[p + "mlp.up_proj.weight"].T
        )
        x = x + mlp @ state[p + "mlp.down_proj.weight"].T
    logits = _rms(x, state["model.norm.weight"], eps) @ emb[d2t].T
    return x, logits


def _fuse(head_dir: Path, feats: torch.Tensor) -> torch.Tensor:
    state = draft_assets.dequantize(load_state(head_dir))  # float weights pass unchanged
    w = state.get("eagle.fuse.weight")
    return feats.float() if w is None else feats.float() @ w.float().T


@pytest.mark.parametrize(
    ("layers", "int8"), [((1, 15, 29), False), ((29,), False), ((3, 20), True)]
)
@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_head_chain_and_tree_match_the_dense_math(embedded_dir, tmp_path, layers, int8, kernel):
    head = make_eagle_dir(tmp_path / "head", embedded_dir, feature_layers=layers, int8=int8)
    # "auto": the packed CPU kernels where they build; "reference": MKL and torch's
    # reference attention.
    backend = {"cpu_kernel": "mkl", "attention_backend": "reference"} if kernel != "auto" else {}
    runner = load_eagle_runner(head, CPU, torch.float32, kv_blocks=64, kv_block_size=16, **backend)
    gen = torch.Generator().manual_seed(3)
    tokens = [int(t) for t in torch.randint(0, 49152, (21,), generator=gen)]
    feats = torch.randn(len(tokens), len(layers) * 576, generator=gen)
    g = _fuse(head, feats)
    g_prev = torch.cat([torch.zeros(1, 576), g[:-1]])
    want_h, want_logits = dense_reference(head, embedded_dir, tokens, g_prev)

    runner.add_sequence("s", tokens)
    # The chain in two parts (committed, then more): paged KV across calls.
    got1, h1 = runner.forward_head(
        [SeqInput.chain("s", tokens[:13])],
        runner.fuse(torch.cat([torch.zeros(1, feats.shape[1]), feats[:12]])),
    )
    runner.commit("s", range(13))
    got2, h2 = runner.forward_head([SeqInput.chain("s", tokens[13:])], runner.fuse(feats[12:20]))
    got_h = torch.cat([h1, h2])
    got_logits = torch.cat([got1, got2])
    torch.testing.assert_close(got_h, want_h, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-3, rtol=2e-3)

    # Two drafted children of the last node read its h as their g.
    runner.commit("s", range(8))
    kids = [5, 77]
    last_h = h2[-1:]
    got_k, _ = runner.forward_head(
        [SeqInput("s", np.array(kids, np.int32), np.array([-1, -1], np.int32))],
        last_h.expand(2, -1),
    )
    for i, kid in enumerate(kids):
        _, ref = dense_reference(
            head, embedded_dir, [*tokens, kid], torch.cat([g_prev, want_h[-1:]])
        )
        torch.testing.assert_close(got_k[i], ref[-1], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kernel", ["auto", "mkl"])
def test_target_features_are_the_layer_outputs(embedded_dir, kernel):
    from transformers import AutoModelForCausalLM

    runner = load_runner(
        embedded_dir,
        device="cpu",
        dtype="float32",
        kv_blocks=16,
        cpu_kernel=kernel,
        attention_backend="reference" if kernel == "mkl" else "auto",
    )
    tokens = [1, 504, 3458, 282, 4649, 314, 253, 1345]
    layers = (0, 14, 29)
    runner.add_sequence("a", tokens)
    logits, feats = runner.forward_features([SeqInput.chain("a", tokens)], layers)
    hf = AutoModelForCausalLM.from_pretrained(str(embedded_dir), local_files_only=True).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    hs = out.hidden_states  # [0] embeddings, [i + 1] layer i (the last one normed)
    assert feats is not None and feats.shape == (len(tokens), 3 * 576)
    torch.testing.assert_close(feats[:, :576], hs[1][0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(feats[:, 576:1152], hs[15][0], atol=1e-3, rtol=1e-3)
    normed = _rms(feats[:, 1152:], hf.model.norm.weight, hf.config.rms_norm_eps)
    torch.testing.assert_close(normed, hs[30][0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(logits, out.logits[0], atol=1e-3, rtol=1e-3)
