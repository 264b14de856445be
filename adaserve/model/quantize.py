"""Int8 linear layers for a draft model on a CPU.

A CPU decode step of a small model is bound by reading its weights. Int8 weights are a
quarter of fp32's bytes. Where adaserve's packed kernel builds (cpu_gemm.py), the
weights are int8 per output feature and the activations stay float32, converted in
registers; a draft step takes ~0.6x of fbgemm's. Elsewhere fbgemm's dynamic-quantization
kernels run it (activations quantized per call, int8 dot products, fp32 out), about
twice as fast as fp32.
Only the drafter may be quantized: its proposals are verified by the target, so they
change how many tokens a step accepts, never which tokens are emitted. The target
always runs in the precision its reference output is defined in.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from adaserve.model.layers import VocabParallelEmbedding, linear_layers
from adaserve.model.llama import LlamaModel

log = logging.getLogger("adaserve.model")


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W int8 per output row (symmetric) and x quantized per call.

    reduce_range keeps activations to 7 bits, which fbgemm needs on CPUs without VNNI
    to avoid saturating its int16 accumulations; it costs nothing measurable here."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight_t.detach().t().contiguous().float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch 2.13 marks quantized tensor creation deprecated (pytorch#184982);
            # fbgemm's prepacked dynamic linear has no replacement in core torch yet.
            warnings.simplefilter("ignore", UserWarning)
            qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        b = None if bias is None else bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qw, b)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)


def quantize_int8(model: LlamaModel, cpu_kernel: str = "auto") -> int:
    """Swap every linear layer of a one-rank fp32 CPU model (and its LM head, when it is
    not tied to the embedding) for an int8 one, in place: the packed kernel's
    (`PackedLinear(int8=True)`) with cpu_kernel "auto" where it builds, else fbgemm's
    Int8Linear. Returns how many."""
    from adaserve.model.cpu_gemm import PackedLinear, packed_kernel_available

    packed = packed_kernel_available(cpu_kernel)
    if not packed and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("int8 drafter quantization needs fbgemm (an x86 CPU build of torch)")
    if not packed:
        torch.backends.quantized.engine = "fbgemm"
    swapped = 0
    for parent, name, child in linear_layers(model):
        if child.tp.size > 1:
            raise ValueError("int8 quantization is for one-rank (tp 1) drafters")
        weight = child.weight_t
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError("int8 quantization runs on the CPU, from float32 weights")
        if isinstance(model.embed, VocabParallelEmbedding) and weight is model.embed.weight_t:
            continue  # a tied LM head: the embedding lookup needs the tensor as it is
        bias = getattr(child, "bias", None)
        layer = PackedLinear(weight, bias, int8=True) if packed else Int8Linear(weight, bias)
        setattr(parent, name, layer)
        swapped += 1
    if packed:
        from adaserve.model.cpu_gemm import supported_isas

        where = f"the packed CPU kernel ({supported_isas()[0]}, int8 weights, fp32 activations)"
    else:
        where = "fbgemm (dynamic int8)"
    log.info("%d linear layers in int8 on %s", swapped, where)
    return swapped
