"""Building blocks of the decoder, tensor-parallel by construction.

Every linear layer knows how it is sharded (`load` takes the full HF tensor and
keeps this rank's slice) and does its own communication in `forward`: column-parallel
layers need none, row-parallel ones `all_reduce`, the vocab-parallel embedding
`all_reduce`s and the LM head `all_gather`s. With one rank these are plain ops.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None with one rank

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of n items split evenly."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {self.size}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def linear_layers(
    model: nn.Module,
) -> Iterator[tuple[nn.Module, str, ColumnParallelLinear | RowParallelLinear | ParallelLMHead]]:
    """(parent, attribute name, layer) of every linear layer and LM head of `model`, for
    the passes that swap them for other kernels (quantize.py, cpu_gemm.py)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, ColumnParallelLinear | RowParallelLinear | ParallelLMHead):
                yield parent, name, child


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # transformers' order for half types: statistics in fp32, cast, then the weight.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ weight_t [in, out] (+ bias)."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with the output features split across ranks; several HF matrices
    can be fused (q|k|v, gate|up), each split separately so every rank holds whole
    heads / whole MLP columns of each part.

    Weights are stored transposed, [in, out]: on CPU, MKL's x @ W_t is 20% faster
    than F.linear's x @ W^T for one token and up to 40% for 4-16 tokens (decode and
    tree verification), and equal for 512-token prefill chunks."""

    def __init__(
        self,
        in_features: int,
        out_parts: list[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.out_parts = out_parts  # full (unsharded) size of each fused part
        local = sum(p // tp.size for p in out_parts)
        self.weight_t = _param((in_features, local), dtype, device)
        self.bias = _param((local,), dtype, device) if bias else None

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        """HF weights [out, in] (and biases [out]) of each fused part, unsharded."""

        def shard(parts: list[torch.Tensor]) -> torch.Tensor:
            out = []
            for t, n in zip(parts, self.out_parts, strict=True):
                a, b = self.tp.split(n, "output features")
                out.append(t[a:b])
            return torch.cat(out, 0)

        self.weight_t.copy_(shard(weights).t())
        if self.bias is not None:
            if biases is None:
                raise ValueError("checkpoint lacks the bias this layer expects")
            self.bias.copy_(shard(biases))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self.weight_t, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T: input features split, partial sums all-reduced.
    The bias is added once, after the reduction. Weight stored [in, out] as above."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.weight_t = _param((in_features // tp.size, out_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        a, b = self.tp.split(self.in_features, "input features")
        self.weight_t.copy_(weight[:, a:b].t())
        if self.bias is not None:
            if bias is None:
                raise ValueError("checkpoint lacks the bias this layer expects")
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        if self.tp.size > 1:
            dist.all_reduce(y, group=self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous vocab slice; ids outside it embed to zero and the
    all-reduce assembles the full embedding.

    Stored as columns, weight_t [dim, vocab slice], so a tied LM head uses the same
    tensor in its fast layout; gathering a few columns costs microseconds."""

    def __init__(
        self, vocab: int, dim: int, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        self.start, self.stop = tp.split(vocab, "vocab_size")
        self.weight_t = _param((dim, self.stop - self.start), dtype, device)

    def load(self, weight: torch.Tensor) -> None:
        """HF embedding [vocab, dim], unsharded."""
        self.weight_t.copy_(weight[self.start : self.stop].t())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.weight_t.index_select(1, ids).t().contiguous()
        inside = (ids >= self.start) & (ids < self.stop)
        local = torch.where(inside, ids - self.start, 0)
        y = self.weight_t.index_select(1, local).t().contiguous()
        y.mul_(inside.unsqueeze(-1).to(y.dtype))
        dist.all_reduce(y, group=self.tp.group)
        return y


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocab slice, all-gathered along the vocab axis. Shares
    the embedding's weight when the model ties them. `rows` may differ from the input
    vocab (a drafter's reduced draft vocabulary)."""

    def __init__(
        self,
        embed: VocabParallelEmbedding,
        tied: bool,
        rows: int,
        dim: int,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tp = tp
        if tied:
            self.start, self.stop = embed.start, embed.stop
            self.weight_t = embed.weight_t
        else:
            self.start, self.stop = tp.split(rows, "LM head rows")
            self.weight_t = _param((dim, self.stop - self.start), dtype, device)

    def load(self, weight: torch.Tensor) -> None:
        """HF lm_head [rows, dim], unsharded."""
        self.weight_t.copy_(weight[self.start : self.stop].t())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = h @ self.weight_t
        if self.tp.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp.size)]
        dist.all_gather(parts, logits, group=self.tp.group)
        return torch.cat(parts, dim=-1)


class Rotary:
    """RoPE on an interleaved head layout: pairs (2i, 2i+1) hold HF's dims (i, i + D/2).

    The loader permutes q/k projection rows into that layout (`interleave`), so
    rotating a pair is one complex multiply, applied in place: one op for q and k of
    all heads instead of rotate-half's five. Attention scores are unchanged because q
    and k are permuted alike. cos/sin are computed in fp32 as transformers does."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_len: int,
        scaling: dict | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        ar = torch.arange(0, head_dim, 2, dtype=torch.int64).float()
        inv_freq = _scale_inv_freq(1.0 / (theta ** (ar / head_dim)), scaling)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()  # [max_len, D/2]
        self.complex = dtype == torch.float32  # no complex type for bf16
        if self.complex:
            self.cis = torch.complex(cos, sin).to(device)
        else:
            self.cos = cos.to(dtype=dtype, device=device)
            self.sin = sin.to(dtype=dtype, device=device)
        self.max_len = max_len

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-forward rotation for positions [T], broadcast over heads: [T, 1, D/2]."""
        if self.complex:
            return (self.cis[positions].unsqueeze(1),)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply_(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> None:
        """Rotate x [T, heads, D] (interleaved layout) in place."""
        pairs = x.view(*x.shape[:-1], -1, 2)
        if self.complex:
            torch.view_as_complex(pairs).mul_(rope[0])
            return
        cos, sin = rope
        a, b = pairs[..., 0], pairs[..., 1]
        a_new = a * cos - b * sin
        b.copy_(b * cos + a * sin)
        a.copy_(a_new)

    @staticmethod
    def interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
        """Permute each head's rows of a q/k projection weight [heads * D, ...] or bias
        [heads * D] from HF's rotate-half order (i, i + D/2) to adjacent pairs."""
        d = w.shape[0] // heads
        order = torch.arange(d).view(2, d // 2).t().reshape(-1)  # 0, D/2, 1, D/2 + 1, ...
        return w.view(heads, d, *w.shape[1:])[:, order].reshape(w.shape)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r}")
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)
