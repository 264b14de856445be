"""A GGUF target's weights at their stored precision on the CPU (`model.quantization:
stored`).

A GGUF file is converted once into a float32 Hugging Face directory (embedded.py), so
the `none` path streams ~4 bytes per weight each step: ~540 MB for the embedded Q4_1
SmolLM2, where llama.cpp reads ~85 MB. Here every linear layer whose GGUF tensor is
Q4_0, Q4_1, Q8_0, Q4_K or Q6_K is swapped for a QuantLinear over the file's own blocks
(cpu_gemm.py; dequantized in registers, never kept in float32; the K-quants'
super-blocks transcoded at load to 32-weight blocks with float32 scales, the same
values), and a tied embedding reads the LM head's blocks. Dequantization is exact,
and the kernel runs the fp32 kernel's FMA chains, so with `model.stored_activations: float32` a `stored` model computes the same
logits as the `none` one on the packed kernel, bit for bit, from a sixth of the bytes.
The default, `int8`, quantizes each token row per 32 features and takes integer dot
products (as llama.cpp does; ~3x faster decode steps than float32, logits within that
rounding). Either way speculation stays lossless: a row's result never depends on the
rows beside it.

Other tensor types (F16, Q5_K, ...) keep their layer in float32 on the packed kernel,
logged. Tensor parallelism is refused: a rank would need its slice of the
quantized blocks (column slices are whole rows of blocks, row slices cut features in
multiples of 32), which is not done.

A model that has no quantized file (a Hugging Face safetensors directory, or any target
under `model.quantization: int4`) gets the same blocks made at load (`serve_int4`):
each linear layer's float32 weights quantized per 32 input features to Q4_1 (4-bit
quants with a float16 scale and minimum: weight-only int4 per group), the LM head and
embedding to Q8_0 (as llama.cpp's own converters keep the output matrix at 8 bits,
where 4 bits costs the most accuracy), by the `gguf` package's reference quantizers,
so the bytes are those llama.cpp's quantizer would write.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from adaserve.model.cpu_gemm import (
    GGML_TYPES,
    GROUP,
    Q4_1,
    Q8_0,
    QuantEmbedding,
    QuantLinear,
    packed_kernel_available,
)
from adaserve.model.embedded import MARKER
from adaserve.model.layers import VocabParallelEmbedding, linear_layers
from adaserve.model.llama import DecoderLayer, LlamaModel

# model.quantization for a target: `auto` is `stored` for a GGUF target where it runs
# (one-rank float32 CPU model, packed kernel built), else `none`.
TARGET_QUANTIZATIONS = ("auto", "none", "stored", "int8", "int4")

log = logging.getLogger("adaserve.model")


def gguf_source(path: Path) -> Path | None:
    """The GGUF file a converted directory was made from (embedded.py's marker), or
    None for a plain Hugging Face directory."""
    marker = path / MARKER
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text())["source"])
    return source if source.is_file() else None


def resolve_quantization(
    quantization: str,
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    tp: int,
    cpu_kernel: str,
) -> str:
    """`quantization` with `auto` decided, for a model in `path`, as what will run:
    `int8` and `int4` on a GPU run unquantized (one settings file serves a laptop and a
    GPU box alike), so `none`; ValueError where `stored` or `int4` is asked for on a CPU
    and cannot run (the message says why)."""
    if quantization not in TARGET_QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r} ({' | '.join(TARGET_QUANTIZATIONS)})"
        )
    if quantization in ("int8", "int4") and device.type != "cpu":
        log.info(
            "%s: %s is for the CPU; on %s it runs unquantized", path.name, quantization, device
        )
        return "none"
    if quantization == "int8" or quantization == "none":
        return quantization
    if quantization == "int4":
        why = _blocks_cannot_run(device, dtype, tp, cpu_kernel)
        if why is not None:
            raise ValueError(f"model.quantization int4: {why}")
        return "int4"
    why = "the model is not a GGUF file (a Hugging Face directory: use none, int8 or int4)"
    if gguf_source(path) is not None:
        why = _blocks_cannot_run(device, dtype, tp, cpu_kernel)
    if why is None:
        return "stored"
    if quantization == "stored":
        raise ValueError(f"model.quantization stored: {why}")
    return "none"


def _blocks_cannot_run(
    device: torch.device, dtype: torch.dtype, tp: int, cpu_kernel: str
) -> str | None:
    """Why QuantLinear's blocks (stored or int4) cannot serve this model, or None."""
    if tp > 1:
        return "tensor parallelism does not shard quantized blocks (use none with tp > 1)"
    if device.type != "cpu" or dtype != torch.float32:
        return f"it runs on the CPU in float32, not on {device} in {dtype}"
    if not packed_kernel_available(cpu_kernel):
        return "it needs the packed CPU kernel (model.cpu_kernel auto, g++, AVX2 or AVX-512)"
    return None


def _raw(tensor) -> torch.Tensor:
    """A GGUF tensor's bytes, uint8 [rows, bytes per row], copied out of the file map."""
    rows = int(np.prod(tensor.shape[1:]))
    return torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))


def _check(layer: QuantLinear, weight_t: torch.Tensor, what: str) -> None:
    """A few columns of `layer` against the float32 weights [in, out] loaded from the
    conversion, bit for bit: another row order than llama.cpp's Llama converter writes
    (or a wrong tensor) fails the load instead of serving wrong logits."""
    cols = torch.tensor(sorted({0, layer.out_features // 2, layer.out_features - 1}))
    if not torch.equal(layer.columns(cols), weight_t[:, cols].t()):
        raise ValueError(f"{what} do not hold the weights loaded from the conversion")


def serve_stored(
    model: LlamaModel, gguf: Path, isa: str | None = None, activations: str = "int8"
) -> Counter[str]:
    """Swap each linear layer of a one-rank CPU model loaded from `gguf`'s conversion
    for a QuantLinear over the file's blocks, in place, and a tied (or any quantized)
    embedding for a lookup into them. Returns how many layers per format ("F32" for
    those left in float32). `activations`: QuantLinear's ("int8" or "float32"). Each swapped layer is checked against its loaded float32
    weights on a few columns, bit for bit: a mismatch (another tensor layout than
    llama.cpp's Llama converter writes) fails the load."""
    import gguf as gguf_lib

    if model.tp.size > 1:
        raise ValueError("model.quantization stored: one rank only (tp 1)")
    reader = gguf_lib.GGUFReader(gguf)
    tensors = {t.name: t for t in reader.tensors}
    formats: Counter[str] = Counter()

    def swap(parent: torch.nn.Module, attr: str, names: list[str]) -> QuantLinear | None:
        child = getattr(parent, attr)
        found = [tensors.get(n) for n in names]
        types = {None if t is None else int(t.tensor_type) for t in found}
        if len(types) != 1 or (kind := types.pop()) not in GGML_TYPES:
            what = ", ".join(
                f"{n} {t.tensor_type.name if t else 'missing'}"
                for n, t in zip(names, found, strict=True)
            )
            log.info("stored weights: %s stays float32 (%s)", attr, what)
            formats["F32"] += 1
            return None
        raw = torch.cat([_raw(t) for t in found if t is not None])
        weight = child.weight_t  # [in, out] float32, as loaded from the conversion
        bias = getattr(child, "bias", None)
        layer = QuantLinear(raw, kind, weight.shape[0], bias, isa=isa, activations=activations)
        _check(layer, weight, f"{gguf.name}: {names}")
        setattr(parent, attr, layer)
        formats[layer.format] += 1
        return layer

    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        b = f"blk.{i}."
        # llama.cpp's converter stores q/k rows in the adjacent-pairs RoPE layout the
        # loader permutes Hugging Face's into (layers.Rotary): the same rows, as checked.
        swap(layer.attn, "qkv", [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"])
        swap(layer.attn, "o_proj", [b + "attn_output.weight"])
        swap(layer.mlp, "gate_up", [b + "ffn_gate.weight", b + "ffn_up.weight"])
        swap(layer.mlp, "down", [b + "ffn_down.weight"])
    embed = model.embed
    assert isinstance(embed, VocabParallelEmbedding)
    tied = model.lm_head.weight_t is embed.weight_t
    head = swap(model, "lm_head", ["token_embd.weight" if tied else "output.weight"])
    if tied and head is not None:
        model.embed = QuantEmbedding(head)
    elif not tied and (t := tensors.get("token_embd.weight")) and int(t.tensor_type) in GGML_TYPES:
        # An untied embedding is a lookup table only: its blocks, gathered per token.
        table = QuantLinear(
            _raw(t), int(t.tensor_type), embed.weight_t.shape[0], isa=isa, activations=activations
        )
        _check(table, embed.weight_t, f"{gguf.name}: token_embd.weight")
        model.embed = QuantEmbedding(table)
    log.info(
        "stored weights from %s: %s linear layers (packed CPU kernel, %s activations)",
        gguf.name,
        ", ".join(f"{n} {f}" for f, n in sorted(formats.items())),
        activations,
    )
    return formats


def quantize_blocks(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Float32 weights [out, in] as GGUF blocks, uint8 [out, in / 32 * block bytes], by
    the `gguf` package's reference quantizer (llama.cpp's arithmetic, so the same bytes
    its quantizer writes)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = weight.detach().float().contiguous().numpy()
    return torch.from_numpy(quantize(w, GGMLQuantizationType(ggml_type)))


def serve_int4(
    model: LlamaModel, isa: str | None = None, activations: str = "int8"
) -> Counter[str]:
    """Quantize each linear layer of a one-rank float32 CPU model at load and swap it for
    a QuantLinear over the blocks, in place: Q4_1 (weight-only int4 per 32 input
    features), the LM head Q8_0, and the embedding a lookup into the head's blocks
    (tied) or its own Q8_0 ones, so no float32 weight matrix stays in memory. A layer
    whose input features are not a multiple of 32 stays float32, logged. Returns how
    many layers per format."""
    if model.tp.size > 1:
        raise ValueError("model.quantization int4: one rank only (tp 1)")
    embed = model.embed
    assert isinstance(embed, VocabParallelEmbedding)
    tied = model.lm_head.weight_t is embed.weight_t
    formats: Counter[str] = Counter()
    for parent, name, child in list(linear_layers(model)):
        weight = child.weight_t  # [in, out]
        if weight.shape[0] % GROUP:
            log.info("int4: %s stays float32 (%d input features)", name, weight.shape[0])
            formats["F32"] += 1
            continue
        head = child is model.lm_head
        kind = Q8_0 if head else Q4_1
        raw = quantize_blocks(weight.t(), kind)
        bias = getattr(child, "bias", None)
        layer = QuantLinear(raw, kind, weight.shape[0], bias, isa=isa, activations=activations)
        setattr(parent, name, layer)
        formats[layer.format] += 1
        if head and tied:
            model.embed = QuantEmbedding(layer)
    if not tied and embed.weight_t.shape[0] % GROUP == 0:
        table = embed.weight_t.t()  # [vocab, hidden]: a lookup table, quantized like the head
        raw = quantize_blocks(table, Q8_0)
        model.embed = QuantEmbedding(
            QuantLinear(raw, Q8_0, table.shape[1], isa=isa, activations=activations)
        )
    log.info(
        "int4 weights: %s linear layers (packed CPU kernel, %s activations)",
        ", ".join(f"{n} {f}" for f, n in sorted(formats.items())),
        activations,
    )
    return formats
