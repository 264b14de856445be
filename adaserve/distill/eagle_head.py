"""The EAGLE head on the training side (math: docs/EAGLE_FORMAT.md,
mirrored in the docstring below), with the training-time test (TTT) unroll.

    g_t    = fuse(features_t)                      (no fuse when F == 1)
    x_t    = fc(cat(embed(tok_t), g_{t-1}))        (g_{-1} = 0)
    h_t    = decoder layers(x_t), causal, RoPE at t
    logits = norm(h_t) @ embed[d2t].T              (predicts tok_{t+1})

A drafted node at t + 1 reads its parent's h_t in place of g_t. So a greedy chain of k
drafts from a committed position r is a plain causal run whose inputs past r are
(draft token, previous h). When the drafts are right (the only case in which a later
draft can be accepted) those inputs are (true token, previous h): `unroll` computes,
for every root r at once, the chain's j-th step at position r + j. Step 0 is the
teacher-forced pass; step k at position p attends to step 0 at positions <= p - k and
to steps 1..k at positions p - k + 1 .. p (its own chain). Training on those steps is
EAGLE-3's "training-time test"; measuring with them gives exact chain acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.distill.llama import Block, LlamaModel, LlamaShape, RMSNorm, _rotate, rope_tables


class EagleHead(nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        num_layers: int,
        feature_layers: Sequence[int],
        embed: nn.Embedding,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.feature_layers = tuple(int(i) for i in feature_layers)
        h, n_feat = shape.hidden, len(self.feature_layers)
        self.fuse = nn.Linear(n_feat * h, h, bias=False) if n_feat > 1 else None
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(Block(shape) for _ in range(num_layers))
        self.norm = RMSNorm(h, shape.eps)
        self.embed_tokens = embed  # the target's: frozen, never saved

    # -- pieces ---------------------------------------------------------------------------
    def fused(self, feats: torch.Tensor) -> torch.Tensor:
        """features [..., F * hidden] -> g [..., hidden]."""
        return feats if self.fuse is None else self.fuse(feats)

    def inputs(self, ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """x = fc(cat(embed(ids), prev)); prev is g_{t-1} (committed) or h_{t-1} (drafted)."""
        return self.fc(torch.cat([self.embed_tokens(ids).to(prev.dtype), prev], -1))

    def logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        n = self.norm(h)  # fp32 when h is bf16 (the norm's weight is fp32)
        return n @ head.to(n.dtype).T

    # -- passes ---------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Teacher-forced h [B, T, hidden]: ids [B, T], feats [B, T, F * hidden] with
        feats[:, t] the target's features at t (the last position's are never read)."""
        return self.unroll(ids, feats, 1)[0]

    def run(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Plain causal decoder pass over inputs x [B, T, hidden] (the reference a
        drafting loop follows: append an input, rerun)."""
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        cos, sin = rope_tables(positions, self.shape.head_dim, self.shape.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin, None, None, 0)
        return x

    def unroll(
        self, ids: torch.Tensor, feats: torch.Tensor, steps: int, start: int = 0
    ) -> list[torch.Tensor]:
        """h for TTT steps 0..steps-1 (module docstring). Step 0 covers all T positions;
        steps >= 1 cover positions start..T-1 only (roots before `start`, e.g. prompt
        positions, are never trained or measured there): [B, T - start, hidden]."""
        b, t = ids.shape
        dev = ids.device
        g = self.fused(feats.to(self.fc.weight.dtype))
        prev0 = torch.cat([g.new_zeros(b, 1, g.shape[-1]), g[:, :-1]], 1)
        pos_all = torch.arange(t, device=dev)
        tables0 = rope_tables(pos_all.expand(b, -1), self.shape.head_dim, self.shape.rope_theta)
        pos_tail = pos_all[start:]
        tables = rope_tables(pos_tail.expand(b, -1), self.shape.head_dim, self.shape.rope_theta)
        # per layer: the K/V of every step so far, [B, kv_heads, len, head_dim]
        keys: list[list[torch.Tensor]] = [[] for _ in self.layers]
        vals: list[list[torch.Tensor]] = [[] for _ in self.layers]
        outs: list[torch.Tensor] = []
        for k in range(steps):
            if k == 0:
                x = self.inputs(ids, prev0)
                cos, sin = tables0
                mask = None
            else:
                last = outs[-1]
                # parent's h at p - 1: step 0 spans all positions, later steps start at `start`
                if k == 1:
                    prev = last[:, start - 1 : t - 1] if start > 0 else _shift(last)
                else:
                    prev = _shift(last)
                x = self.inputs(ids[:, start:], prev)
                cos, sin = tables
                mask = _ttt_mask(t, start, k, dev)
            for li, layer in enumerate(self.layers):
                assert isinstance(layer, Block)
                x = _block(layer, x, cos, sin, keys[li], vals[li], mask)
            outs.append(x)
        return outs


def _shift(h: torch.Tensor) -> torch.Tensor:
    """h at p - 1 for each p (zeros at the first position)."""
    return torch.cat([h.new_zeros(h.shape[0], 1, h.shape[2]), h[:, :-1]], 1)


def _ttt_mask(t: int, start: int, k: int, device) -> torch.Tensor:
    """bool [T - start, T + k * (T - start)]: queries = step k at positions start..T-1;
    keys = step 0 at 0..T-1, then steps 1..k at start..T-1."""
    q = torch.arange(start, t, device=device)[:, None]
    blocks = [torch.arange(t, device=device)[None] <= q - k]  # committed prefix of the root
    tail = torch.arange(start, t, device=device)[None]
    blocks += [tail == q - k + j for j in range(1, k + 1)]  # the chain's own nodes
    return torch.cat(blocks, 1)


def _block(
    layer: Block,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: list[torch.Tensor],
    vals: list[torch.Tensor],
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One decoder layer whose attention also sees earlier steps' K/V (appended here)."""
    at = layer.self_attn
    s = at.s
    b, t, _ = x.shape
    hx = layer.input_layernorm(x)
    q = at.q_proj(hx).view(b, t, s.heads, s.head_dim).transpose(1, 2)
    k = at.k_proj(hx).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
    v = at.v_proj(hx).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    keys.append(k)
    vals.append(v)
    group = s.heads // s.kv_heads
    kk = torch.cat(keys, 2).repeat_interleave(group, 1)
    vv = torch.cat(vals, 2).repeat_interleave(group, 1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    x = x + at.o_proj(out.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def init_head(
    teacher: LlamaModel, num_layers: int, feature_layers: Sequence[int], init_from: int
) -> EagleHead:
    """A head whose decoder layers start as copies of teacher layer `init_from` (the last
    one by default: its output already feeds the shared norm and LM head, so the head
    starts near "one more target layer"), with the teacher's final norm; fuse starts by
    picking the last listed feature layer and fc by adding the token embedding to g, so
    step 0 begins as an EAGLE-1 head over that layer."""
    dev = teacher.embed_tokens.weight.device
    head = EagleHead(teacher.shape, num_layers, feature_layers, teacher.embed_tokens).to(dev)
    for layer in head.layers:
        layer.load_state_dict(teacher.layers[init_from].state_dict())
    head.norm.load_state_dict(teacher.norm.state_dict())
    h = teacher.shape.hidden
    eye = torch.eye(h, device=dev)
    with torch.no_grad():
        if head.fuse is not None:
            w = torch.randn_like(head.fuse.weight) * 0.02 / len(head.feature_layers)
            w[:, -h:] += eye
            head.fuse.weight.copy_(w)
        head.fc.weight.copy_(torch.cat([eye, eye], 1) + torch.randn(h, 2 * h, device=dev) * 0.01)
    return head


def head_state(head: EagleHead) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps: every weight but the borrowed embedding."""
    return {
        k: v.detach().clone()
        for k, v in head.state_dict().items()
        if not k.startswith("embed_tokens.")
    }
