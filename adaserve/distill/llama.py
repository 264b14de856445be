"""A compact pure-PyTorch Llama decoder for distillation: teacher and student.

Training needs dense batches (right-padded, causal) and target generation needs a
static KV cache over left-padded prompts; the serving runtime's paged tree KV is the
wrong tool for both. Module names match Hugging Face's `LlamaForCausalLM` without the
`model.` prefix, so HF state dicts load directly (see `weights.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaShape:
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if (rope.get("rope_type") or "default") != "default" or cfg.get("rope_scaling"):
            raise ValueError("distillation supports plain RoPE targets only (no rope scaling)")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("distillation supports bias-free Llama targets only")
        heads = int(cfg["num_attention_heads"])
        return cls(
            vocab=int(cfg["vocab_size"]),
            hidden=int(cfg["hidden_size"]),
            intermediate=int(cfg["intermediate_size"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rope_theta=float(theta),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [B, 1, T, head_dim] for positions int64 [B, T] (HF rotate_half layout)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    ang = positions.float()[..., None] * inv  # [B, T, head_dim/2]
    ang = torch.cat([ang, ang], dim=-1)[:, None]
    return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class KVCache:
    """Static per-layer K/V [B, kv_heads, max_len, head_dim]; all rows share a write slot.

    With `slot` set (a one-element int64 tensor), a one-token step writes there and
    attends over the whole cache (the mask hides unwritten slots): every shape is then
    fixed, so the step can be captured in a CUDA graph and replayed."""

    def __init__(
        self, shape: LlamaShape, layers: int, batch: int, max_len: int, device, dtype
    ) -> None:
        size = (batch, shape.kv_heads, max_len, shape.head_dim)
        self.k = [torch.zeros(size, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(size, device=device, dtype=dtype) for _ in range(layers)]
        self.start = 0  # slot of the next write
        self.slot: torch.Tensor | None = None

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slot is not None:
            self.k[layer].index_copy_(2, self.slot, k)
            self.v[layer].index_copy_(2, self.slot, v)
            return self.k[layer], self.v[layer]
        end = self.start + k.shape[2]
        self.k[layer][:, :, self.start : end] = k
        self.v[layer][:, :, self.start : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        s = self.s
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = s.heads // s.kv_heads
        if cache is None:
            # Dense causal batch (training): expanding K/V keeps SDPA on its flash path.
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Cached generation: fold each KV group's query heads into the query axis so
            # the (large) cache is read once per group instead of being expanded.
            k, v = cache.append(layer, k, v)
            qg = q.reshape(b, s.kv_heads, group * t, s.head_dim)
            m = mask.repeat(1, 1, group, 1)  # [B, 1, group*t, S]
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m)
            out = out.reshape(b, s.heads, t, s.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))


class MLP(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s)

    def forward(self, x, cos, sin, mask, cache, layer) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder stack returning final-normed hidden states; the LM head is `embed_tokens`
    rows (tied), optionally a subset (`head_rows`) for a reduced draft vocabulary."""

    def __init__(self, shape: LlamaShape, num_layers: int) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(Block(shape) for _ in range(num_layers))
        self.norm = RMSNorm(shape.hidden, shape.eps)

    def forward(
        self,
        ids: torch.Tensor,  # int64 [B, T]
        positions: torch.Tensor | None = None,  # int64 [B, T]; default arange (training)
        mask: torch.Tensor | None = None,  # bool [B, 1, T, S] with a cache
        cache: KVCache | None = None,
    ) -> torch.Tensor:  # [B, T, hidden]
        return self.forward_features(ids, (), positions, mask, cache)[0]

    def forward_features(
        self,
        ids: torch.Tensor,
        feature_layers: tuple[int, ...] | list[int],
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward, plus the residual stream after each of `feature_layers` (before the
        final norm), concatenated in that order: [B, T, len * hidden], or None when no
        layer is asked for. An EAGLE head reads these (the target's "features")."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        cos, sin = rope_tables(positions, self.shape.head_dim, self.shape.rope_theta)
        x = self.embed_tokens(ids)
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i)
            if i in feature_layers:
                kept[i] = x
        if cache is not None:
            cache.start += ids.shape[1]
        if len(kept) != len(set(feature_layers)):
            raise ValueError(f"feature layers {feature_layers} outside 0..{len(self.layers) - 1}")
        feats = torch.cat([kept[i] for i in feature_layers], -1) if feature_layers else None
        return self.norm(x), feats

    def logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., rows] against `head` (default: all embeddings)."""
        w = self.embed_tokens.weight if head is None else head
        return hidden @ w.to(hidden.dtype).T
