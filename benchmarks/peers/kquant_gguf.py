"""A K-quant GGUF to check adaserve's K-quant kernels against llama.cpp (issue 32): the
embedded SmolLM2 file with its 30 down projections (1536 input features, a multiple of
256) re-quantized to Q4_K in even layers and Q6_K in odd ones, as a Q4_K_M file mixes
the two; every other tensor and all metadata copied. The `gguf` package dequantizes
K-quants but does not quantize them, so the quantizers here are plain ones (a scale and
minimum per sub-block from its range, not llama.cpp's search): any valid blocks serve
a check of how they are read.

    .venv/bin/python benchmarks/peers/kquant_gguf.py /tmp/kq/SmolLM2-135M-Instruct.K.gguf
    .venv/bin/python benchmarks/peers/logits_check.py --gguf /tmp/kq/SmolLM2-135M-Instruct.K.gguf

`tests/test_stored_weights.py` serves the same file (stored = `none`, bit for bit).
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize


def q4_k_quantize(w: np.ndarray) -> np.ndarray:
    """Float32 [rows, k] as Q4_K super-blocks, uint8 [rows, k / 256 * 144]: per 32-weight
    sub-block a scale and minimum from its range, both as 6-bit multiples of the
    super-block's float16 d and dmin (a plain quantizer, not llama.cpp's search; any
    valid blocks do here)."""
    rows, k = w.shape
    sub = w.reshape(rows, k // 256, 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(-1), 0.0)  # [r, s, 8]
    step = np.maximum(sub.max(-1) - lo, 1e-8) / 15
    d = (step.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (np.maximum(-lo.min(-1, keepdims=True), 1e-8) / 63).astype(np.float16)
    sc = np.clip(np.ceil(step / d.astype(np.float64)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin.astype(np.float64)), 0, 63).astype(np.uint8)
    scale = (d.astype(np.float32) * sc)[..., None].astype(np.float64)
    offset = (dmin.astype(np.float32) * mn)[..., None].astype(np.float64)
    q = np.clip(np.round((sub + offset) / scale), 0, 15).astype(np.uint8)  # [r, s, 8, 32]
    scales = np.empty((rows, k // 256, 12), np.uint8)
    scales[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    qs = q[:, :, 0::2] | (q[:, :, 1::2] << 4)  # chunk c: sub-block 2c low, 2c + 1 high
    blocks = np.concatenate(
        [d.view(np.uint8), dmin.view(np.uint8), scales, qs.reshape(rows, k // 256, 128)], -1
    )
    return blocks.reshape(rows, -1)


def q6_k_quantize(w: np.ndarray) -> np.ndarray:
    """Float32 [rows, k] as Q6_K super-blocks, uint8 [rows, k / 256 * 210]: per 16-weight
    sub-block an int8 multiple of the super-block's float16 d as its scale (a plain
    quantizer, as q4_k_quantize)."""
    rows, k = w.shape
    sub = w.reshape(rows, k // 256, 16, 16).astype(np.float64)
    step = np.maximum(np.abs(sub).max(-1), 1e-8) / 31  # [r, s, 16]
    d = (step.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.ceil(step / d.astype(np.float64)), 1, 127).astype(np.int8)
    scale = (d.astype(np.float32) * sc)[..., None].astype(np.float64)
    q = (np.clip(np.round(sub / scale), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, k // 256, 2, 128)  # two halves of 128 weights
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)  # [r, s, 2, 64]
    hi = (q >> 4).reshape(rows, k // 256, 2, 4, 32)
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    blocks = np.concatenate(
        [
            ql.reshape(rows, k // 256, 128),
            qh.reshape(rows, k // 256, 64),
            sc.view(np.uint8),
            d.view(np.uint8),
        ],
        -1,
    )
    return blocks.reshape(rows, -1)


def with_k_quant_down_projections(src: Path, dst: Path) -> int:
    """A copy of the GGUF at `src` whose ffn_down tensors (1536 input features, a
    multiple of 256) are re-quantized, to Q4_K in even layers and Q6_K in odd ones (a
    Q4_K_M file mixes the two likewise); returns how many."""
    reader = GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    data = {}
    for t in reader.tensors:
        raw, kind = np.array(t.data), t.tensor_type
        if t.name.endswith("ffn_down.weight"):
            w = dequantize(raw, kind).astype(np.float32).reshape(raw.shape[0], -1)
            if int(t.name.split(".")[1]) % 2:
                raw, kind = q6_k_quantize(w), GGMLQuantizationType.Q6_K
            else:
                raw, kind = q4_k_quantize(w), GGMLQuantizationType.Q4_K
        data[t.name] = raw
        writer.add_tensor_info(t.name, raw.shape, raw.dtype, raw.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(data[t.name])
    writer.close()
    return sum(name.endswith("ffn_down.weight") for name in data)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: kquant_gguf.py OUT.gguf", file=sys.stderr)
        return 2
    from adaserve.model.embedded import embedded_gguf

    out = Path(args[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    n = with_k_quant_down_projections(embedded_gguf(), out)
    print(f"wrote {out}: {n} down projections re-quantized (Q4_K even layers, Q6_K odd)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    raise SystemExit(main())
