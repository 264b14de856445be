"""The Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, SmolLM2, Mistral) over packed
tokens: hidden states are [T, hidden] for all sequences of the batch together; the
attention backend knows which tokens belong to which sequence.

q|k|v and gate|up are fused into one matmul each (fewer ops per layer matters on
CPU, where a 135M model's decode step is mostly overhead and weight reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.model.attention import AttentionBackend
from adaserve.model.config import ModelConfig, UnsupportedModelError
from adaserve.model.kv_cache import KVStorage
from adaserve.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    Rotary,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from adaserve.model.weights import WeightSource

if TYPE_CHECKING:  # cpu_gemm and cpu_layers import this module
    from adaserve.model.cpu_gemm import PackedEmbedding, QuantEmbedding
    from adaserve.model.cpu_layers import CpuLayers


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        tp.split(cfg.num_heads, "num_attention_heads")
        tp.split(cfg.num_kv_heads, "num_key_value_heads")
        self.layer = layer
        d = cfg.head_dim
        self.heads = cfg.num_heads // tp.size
        self.kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = d
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
            cfg.qkv_bias,
            tp,
            dtype,
            device,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, tp, dtype, device
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        rope: tuple[torch.Tensor, ...],
        backend: AttentionBackend,
        kv: KVStorage,
        meta: Any,
    ) -> torch.Tensor:
        t, d, h = x.shape[0], self.head_dim, self.heads
        qkv = self.qkv(x)  # [T, (heads + 2 * kv_heads) * D]: q | k | v
        rotary.apply_(qkv[:, : (h + self.kv_heads) * d].view(t, -1, d), rope)  # q and k
        q = qkv[:, : h * d].view(t, h, d)
        kv_new = qkv[:, h * d :].view(t, 2, self.kv_heads, d)  # k | v, as the cache stores
        return self.o_proj(backend.attend(self.layer, q, kv_new, kv, meta))


class MLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.local = i // tp.size
        self.gate_up = ColumnParallelLinear(
            cfg.hidden_size, [i, i], cfg.mlp_bias, tp, dtype, device
        )
        self.down = RowParallelLinear(i, cfg.hidden_size, cfg.mlp_bias, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.local, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.attn = Attention(cfg, layer, tp, dtype, device)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, tp, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        rope: tuple[torch.Tensor, ...],
        backend: AttentionBackend,
        kv: KVStorage,
        meta: Any,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), rotary, rope, backend, kv, meta)
        return x.add_(self.mlp(self.post_norm(x)))  # x is this layer's own tensor


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        head_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        # The packed CPU kernel swaps a tied embedding for a PackedEmbedding after
        # loading, or a QuantEmbedding over a GGUF's stored blocks (stored.py).
        self.embed: VocabParallelEmbedding | PackedEmbedding | QuantEmbedding = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp, dtype, device) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(
            self.embed,
            cfg.tie_word_embeddings,
            head_rows or cfg.vocab_size,
            cfg.hidden_size,
            tp,
            dtype,
            device,
        )
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, max_len, cfg.rope_scaling, dtype, device)
        # Every layer in one library call, where build.py put the whole stack on the
        # CPU library (cpu_layers.py); None: module by module.
        self.cpu_layers: CpuLayers | None = None

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv: KVStorage,
        meta: Any,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """ids, positions: [T]; logits_rows: which of the T tokens need logits (None: all).
        Returns logits [rows, vocab] in the model dtype."""
        return self.forward_features(ids, positions, backend, kv, meta, logits_rows, ())[0]

    def forward_features(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv: KVStorage,
        meta: Any,
        logits_rows: torch.Tensor | None,
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the residual stream after each of `feature_layers` (before
        the final norm), concatenated in that order: [T, len * hidden], every row (an
        EAGLE head reads them, adaserve/model/eagle.py); None when none are asked."""
        x = self.embed(ids)
        rope = self.rotary.tables(positions)
        if self.cpu_layers is not None and self.cpu_layers.takes(meta):
            x, feats = self.cpu_layers.run(x, rope[0], kv, meta, feature_layers)
        else:
            x, feats = self._layers(x, rope, backend, kv, meta, feature_layers)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)
        return self.lm_head(self.norm(x)), feats

    def _layers(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        backend: AttentionBackend,
        kv: KVStorage,
        meta: Any,
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        want = {int(i): k for k, i in enumerate(feature_layers)}
        taken: list[torch.Tensor | None] = [None] * len(want)
        for i, layer in enumerate(self.layers):
            x = layer(x, self.rotary, rope, backend, kv, meta)
            if i in want:  # each layer returns a tensor of its own: no copy needed
                taken[want[i]] = x
        feats = None
        if want:
            if any(t is None for t in taken):
                raise ValueError(f"feature layers {list(feature_layers)} not all in this model")
            feats = torch.cat([t for t in taken if t is not None], dim=-1)
        return x, feats

    @torch.no_grad()
    def load_weights(self, src: WeightSource) -> None:
        cfg = self.cfg
        prefix = _prefix(src)
        get = lambda name: src.get(prefix + name)  # noqa: E731
        opt = lambda name: src.get(prefix + name) if src.has(prefix + name) else None  # noqa: E731
        if not isinstance(self.embed, VocabParallelEmbedding):
            raise RuntimeError("load_weights: weights load before the CPU kernel packs them")
        self.embed.load(get("model.embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)  # ModuleList items are typed as Module
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = ["q_proj", "k_proj", "v_proj"]
            heads = [cfg.num_heads, cfg.num_kv_heads, None]  # q, k get the RoPE layout
            layer.attn.qkv.load(
                [_rope_rows(get(f"{a}{n}.weight"), nh) for n, nh in zip(qkv, heads, strict=True)],
                [_rope_rows(get(f"{a}{n}.bias"), nh) for n, nh in zip(qkv, heads, strict=True)]
                if cfg.qkv_bias
                else None,
            )
            layer.attn.o_proj.load(get(a + "o_proj.weight"), opt(a + "o_proj.bias"))
            m = p + "mlp."
            layer.mlp.gate_up.load(
                [get(m + "gate_proj.weight"), get(m + "up_proj.weight")],
                [get(m + "gate_proj.bias"), get(m + "up_proj.bias")] if cfg.mlp_bias else None,
            )
            layer.mlp.down.load(get(m + "down_proj.weight"), opt(m + "down_proj.bias"))
            layer.input_norm.weight.copy_(get(p + "input_layernorm.weight"))
            layer.post_norm.weight.copy_(get(p + "post_attention_layernorm.weight"))
        self.norm.weight.copy_(get("model.norm.weight"))
        if not cfg.tie_word_embeddings:
            self.lm_head.load(get("lm_head.weight"))


def _rope_rows(w: torch.Tensor, heads: int | None) -> torch.Tensor:
    return w if heads is None else Rotary.interleave(w, heads)


def _prefix(src: WeightSource) -> str:
    if src.has("model.embed_tokens.weight"):
        return ""
    raise UnsupportedModelError(
        f"{src.path}: no model.embed_tokens.weight in the checkpoint (not a Llama-family "
        f"causal LM checkpoint?)"
    )
