"""A GGUF target served at its stored precision (`model.quantization: stored`,
adaserve/model/stored.py, QuantLinear in cpu_gemm.py), on the real embedded SmolLM2
file (Q4_1 layers, a Q8_0 tied embedding), on Q4_0 blocks quantized by the `gguf`
package and on random Q4_K and Q6_K super-blocks: the kernel's products are within float32 accumulation error of a float64
matmul of the `gguf` package's own dequantization, a row's result is the same bits
whatever rows are beside it and on either build, the model's logits are those of the
float32 (`none`) model, and speculation on it emits the stored target's own greedy
tokens and its own seeded samples. The AVX-512 and AVX2 builds are each checked where
the CPU runs them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.model import cpu_gemm
from adaserve.model.cpu_gemm import QuantEmbedding, QuantLinear
from adaserve.model.embedded import embedded_gguf
from adaserve.model.loader import load_runner, load_tokenizer
from adaserve.model.runner import SeqInput
from adaserve.model.stored import gguf_source, resolve_quantization
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.sampling import TokenRng
from adaserve.scheduler import LocalScheduler
from adaserve.speculate import BeamDrafter
from benchmarks.peers.kquant_gguf import with_k_quant_down_projections
from tests._engine import run_to_completion
from tests._kernels import ISAS, RUNNABLE, logits_of, needs_kernel
from tests._spec_loop import generate, random_budget
from tests._stats import single_thread

pytestmark = needs_kernel
ROWS = [1, 3, 5, 8, 16, 37]


@pytest.fixture(scope="module")
def gguf_tensors() -> dict[str, tuple[torch.Tensor, int, np.ndarray]]:
    """name -> (raw blocks uint8 [out, bytes], ggml type, float32 [out, in] from the
    gguf package's dequantize): three real tensors (the token embedding cut to 2000
    rows), a Q4_0 one quantized here and Q4_K and Q6_K ones of random blocks (the file
    holds none of those)."""
    reader = GGUFReader(embedded_gguf())
    found = {t.name: t for t in reader.tensors}
    out = {}
    for name, rows in [
        ("blk.0.attn_q.weight", None),
        ("blk.7.ffn_down.weight", None),
        ("token_embd.weight", 2000),
    ]:
        t = found[name]
        raw = np.array(t.data[:rows], dtype=np.uint8)
        w = dequantize(raw, t.tensor_type).astype(np.float32).reshape(raw.shape[0], -1)
        out[name] = (torch.from_numpy(raw), int(t.tensor_type), w)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((77, 160)).astype(np.float32)  # 77: a padded column block
    raw = quantize(w, GGMLQuantizationType.Q4_0)
    deq = dequantize(raw, GGMLQuantizationType.Q4_0).astype(np.float32)
    out["q4_0"] = (torch.from_numpy(raw), int(GGMLQuantizationType.Q4_0), deq)
    out["q4_k"] = _random_q4_k(rng, 77, 512)
    out["q6_k"] = _random_q6_k(rng, 77, 512)
    return out


def _random_q6_k(
    rng: np.random.Generator, rows: int, k: int
) -> tuple[torch.Tensor, int, np.ndarray]:
    """Q6_K super-blocks of random bytes (the `gguf` package does not quantize Q6_K
    either): any quants, any int8 scales (negative ones too), float16 d ~1e-3."""
    kind = GGMLQuantizationType.Q6_K
    blocks = rng.integers(0, 256, (rows, k // 256, 210), dtype=np.uint8)
    d = (rng.uniform(0.5, 2.0, (rows, k // 256, 1)) / 1024).astype(np.float16)
    blocks[..., 208:210] = d.view(np.uint8)
    raw = blocks.reshape(rows, -1)
    deq = dequantize(raw, kind).astype(np.float32).reshape(rows, k)
    return torch.from_numpy(raw), int(kind), deq


def _random_q4_k(
    rng: np.random.Generator, rows: int, k: int
) -> tuple[torch.Tensor, int, np.ndarray]:
    """Q4_K super-blocks of random bytes (the `gguf` package dequantizes Q4_K but does
    not quantize it): any 6-bit scales and minimums, any quants, float16 d ~1e-3 and
    dmin ~4e-3. Weight 0 of every 32-weight sub-block is q = 0, so each sub-block's
    minimum is one of its weights, as a quantizer's is (int8_activation_bound's premise)."""
    kind = GGMLQuantizationType.Q4_K
    blocks = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)
    d = (rng.uniform(0.5, 2.0, (rows, k // 256, 1)) / 1024).astype(np.float16)
    dmin = (rng.uniform(0.5, 2.0, (rows, k // 256, 1)) / 256).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8)
    blocks[..., 2:4] = dmin.view(np.uint8)
    blocks[..., 16::32] = 0  # byte 0 of each quant chunk: weight 0 of two sub-blocks
    raw = blocks.reshape(rows, -1)
    deq = dequantize(raw, kind).astype(np.float32).reshape(rows, k)
    return torch.from_numpy(raw), int(kind), deq


def test_the_file_holds_what_the_kernel_serves(gguf_tensors):
    types = {name: cpu_gemm.GGML_TYPES[t][0] for name, (_, t, _) in gguf_tensors.items()}
    assert types == {
        "blk.0.attn_q.weight": "Q4_1",
        "blk.7.ffn_down.weight": "Q4_1",
        "token_embd.weight": "Q8_0",
        "q4_0": "Q4_0",
        "q4_k": "Q4_K",
        "q6_k": "Q6_K",
    }


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "name",
    ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight", "q4_0", "q4_k", "q6_k"],
)
def test_products_match_a_float64_matmul_of_the_dequantized_weights(gguf_tensors, name, isa):
    """Dequantization is exact, so the only error is float32 accumulation: per output
    at most ~K * eps * sum_k |x_k w_k| (K sequential FMAs, each rounding at most eps
    relative to the running magnitude, which sum |x w| bounds)."""
    raw, kind, w = gguf_tensors[name]
    k = w.shape[1]
    layer = QuantLinear(raw, kind, k, isa=isa)
    w64 = torch.from_numpy(w).double()
    eps = torch.finfo(torch.float32).eps
    g = torch.Generator().manual_seed(k)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        y = layer(x)
        ref = x.double() @ w64.t()
        bound = k * eps * (x.double().abs() @ w64.abs().t())
        assert y.shape == (rows, w.shape[0]) and y.dtype == torch.float32
        assert ((y.double() - ref).abs() <= bound).all(), (name, rows)


def int8_activation_bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """|y - x W^T| per output for activations "int8", derived from the computation.
    Each row's group g of 32 features is quantized as x ~= dx * q, dx = amax / 127,
    q = round(x / dx), so |x_k - dx q_k| <= dx / 2 (x 1 + 1e-5: q rounds x * (127 /
    amax), within a few ulps of x / dx); the integer sums are exact, so in exact
    arithmetic the error is sum_g dx_g / 2 * sum_{k in g} |w_k|. On top, float32: per
    group dw * dx (one rounding), the float32 sx = dx * sum q (one), and a chain of
    2G FMAs (Q4_x: the minimum term too) over G groups, each rounding at most eps
    relative to its running magnitude, which sum_k (|dw q_k| + |mw|) |dx q_k| bounds;
    |dw q| + |mw| <= |w| + 2 max_g |w| (ggml's Q4_1 minimum and Q4_0's 8 |d| are
    each some weight of the block) and |dx q_k| <= |x_k| + dx / 2."""
    x64 = x.double()
    rows, k = x64.shape
    groups = k // 32
    dx = x64.view(rows, groups, 32).abs().amax(-1) / 127  # [rows, G]
    w64 = torch.from_numpy(w).double().abs()  # [N, K]
    wg = w64.view(-1, groups, 32)
    quant = (dx / 2 * (1 + 1e-5)) @ wg.sum(-1).t()
    w_eff = (wg + 2 * wg.amax(-1, keepdim=True)).reshape(-1, k)
    x_eff = x64.abs() + (dx / 2).repeat_interleave(32, dim=1)
    eps = torch.finfo(torch.float32).eps
    return quant + (2 * groups + 2) * eps * (x_eff @ w_eff.t())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "name",
    ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight", "q4_0", "q4_k", "q6_k"],
)
def test_int8_activation_products_are_within_the_derived_bound(gguf_tensors, name, isa):
    """Against a float64 matmul of the `gguf` package's dequantization and the exact
    float32 activations (int8_activation_bound says why the bound holds); and the
    error is mostly activation rounding, not a lost term: well above float32 noise."""
    raw, kind, w = gguf_tensors[name]
    k = w.shape[1]
    layer = QuantLinear(raw, kind, k, isa=isa, activations="int8")
    w64 = torch.from_numpy(w).double()
    g = torch.Generator().manual_seed(k)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        x[0, :32] *= 100  # one outlier group: its scale, not its neighbours', grows
        y = layer(x)
        ref = x.double() @ w64.t()
        err = (y.double() - ref).abs()
        assert y.shape == (rows, w.shape[0]) and y.dtype == torch.float32
        assert (err <= int8_activation_bound(x, w)).all(), (name, rows)
    assert err.max() > 1e-3 * ref.abs().max()


@pytest.mark.parametrize("activations", cpu_gemm.ACTIVATIONS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "name", ["blk.7.ffn_down.weight", "token_embd.weight", "q4_0", "q4_k", "q6_k"]
)
def test_a_row_is_bitwise_the_same_whatever_rows_are_beside_it(
    gguf_tensors, name, isa, activations
):
    """The lossless argument: a tree node's logits are a plain decode step's (int8
    activations: each row quantized on its own, each output's sum in group order)."""
    raw, kind, w = gguf_tensors[name]
    layer = QuantLinear(raw, kind, w.shape[1], isa=isa, activations=activations)
    x = torch.randn(37, w.shape[1], generator=torch.Generator().manual_seed(3))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(37)])
    for m in [*range(2, 17), 37]:
        assert torch.equal(layer(x[:m]), alone[:m]), m
    if activations == "int8":
        return
    # ...and the fp32 kernel over the dequantized weights runs the same FMA chains.
    dense = cpu_gemm.PackedLinear(torch.from_numpy(w).t().contiguous(), None, isa=isa)
    assert torch.equal(dense(x), alone)


@pytest.mark.skipif(len(RUNNABLE) < 2, reason="needs a CPU that runs both builds (AVX-512)")
@pytest.mark.parametrize("activations", cpu_gemm.ACTIVATIONS)
@pytest.mark.parametrize(
    "name", ["blk.0.attn_q.weight", "token_embd.weight", "q4_0", "q4_k", "q6_k"]
)
def test_every_build_gives_the_avx2_builds_bits(gguf_tensors, name, activations):
    raw, kind, w = gguf_tensors[name]
    b = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(1))
    x = torch.randn(13, w.shape[1], generator=torch.Generator().manual_seed(2))
    k = w.shape[1]
    narrow = QuantLinear(raw, kind, k, b, isa="avx2", activations=activations)(x)
    for isa in RUNNABLE[:-1]:  # avx512, and avx512vnni where the CPU has VNNI
        got = QuantLinear(raw, kind, k, b, isa=isa, activations=activations)(x)
        assert torch.equal(got, narrow), isa


@pytest.mark.parametrize("activations", cpu_gemm.ACTIVATIONS)
@pytest.mark.parametrize(
    "name", ["blk.0.attn_q.weight", "token_embd.weight", "q4_0", "q4_k", "q6_k"]
)
def test_columns_and_embedding_lookups_are_the_gguf_values(gguf_tensors, name, activations):
    raw, kind, w = gguf_tensors[name]
    layer = QuantLinear(raw, kind, w.shape[1], activations=activations)
    # The blocks and nothing else, for whole blocks of 32 columns (the K-quants' with
    # float32 scales: Q4_K 24 bytes per 32 weights where the file has 18, Q6_K 40 for
    # 26.25), not float32.
    out, k = w.shape
    padded = -(-out // 32) * 32
    assert layer.packed.nbytes == padded * (k // 32) * cpu_gemm.GGML_TYPES[kind][1]
    assert layer.packed.nbytes < padded * k * 4 / 3  # under a third of float32
    ids = torch.tensor([[0, 5, w.shape[0] - 1], [16, 31, 32]])
    got = QuantEmbedding(layer)(ids)
    assert torch.equal(got, torch.from_numpy(w)[ids])


@pytest.fixture(scope="module")
def stored():
    """Stored weights, int8 activations (the opt-in fast path)."""
    yield _stored_runner("int8")


def _stored_runner(activations: str):
    with single_thread():
        return load_runner(
            "embedded",
            device="cpu",
            kv_blocks=128,
            quantization="stored",
            stored_activations=activations,
        )


PROMPT = [1, 504, 3458, 282, 1167, 314, 253, 1123, 30, 2, 9, 47]


@pytest.fixture(scope="module")
def reference():
    with single_thread():
        yield load_runner("embedded", device="cpu", kv_blocks=128, quantization="none")


def test_the_stored_model_keeps_no_float32_weights_and_its_logits_are_the_none_models(
    stored, reference
):
    """Every linear layer on the file's blocks (Q4_1) and the tied embedding / LM head
    on its Q8_0 ones, ~100 MB where float32 was ~540 MB; with float32 activations,
    since dequantization is exact and the FMA chains are the fp32 kernel's, the logits
    of the float32 model (checked against Hugging Face in test_lossless_smollm2) bit
    for bit."""
    assert load_settings(None).model.stored_activations == "float32"
    with single_thread():
        exact = load_runner(
            "embedded",
            device="cpu",
            kv_blocks=128,
            quantization="stored",
            stored_activations="float32",
        )
    for runner in (stored, exact):
        model = runner.model
        assert runner.quantization == "stored"
        assert runner.weight_formats == {"Q4_1": 120, "Q8_0": 1}
        assert isinstance(model.embed, QuantEmbedding) and model.embed.head is model.lm_head
        weights = sum(m.packed.nbytes for m in model.modules() if isinstance(m, QuantLinear))
        params = sum(p.nbytes for p in model.parameters())  # the norms alone remain
        assert 90e6 < weights < 110e6 and params < 1e6
    layers = [m for m in stored.model.modules() if isinstance(m, QuantLinear)]
    assert {m.activations for m in layers} == {"int8"}
    assert reference.quantization == "none"
    with single_thread():
        assert torch.equal(logits_of(exact, PROMPT), logits_of(reference, PROMPT))


def test_int8_activation_logits_stay_close_to_the_float32_ones(stored, reference):
    """The per-layer bound (int8_activation_bound) does not compose into a useful
    bound through 30 layers of norms and attention, so this is an empirical check,
    not a derived one, on the 12 positions of PROMPT: KL(float32 || int8) per position
    at most 0.05 nats (measured <= 0.025) and no token's probability moved by more
    than 0.1 (measured <= 0.04). (At one position of 12 the top token changes: a near
    tie.)"""
    with single_thread():
        got, want = logits_of(stored, PROMPT), logits_of(reference, PROMPT)
    assert not torch.equal(got, want)
    p, q = torch.log_softmax(want.double(), -1), torch.log_softmax(got.double(), -1)
    assert ((p.exp() * (p - q)).sum(-1) <= 0.05).all()
    assert ((p.exp() - q.exp()).abs() <= 0.1).all()


@pytest.fixture(scope="module")
def exact():
    """Stored weights, float32 activations."""
    yield _stored_runner("float32")


LONG = np.random.default_rng(0).integers(3, 40000, 70).tolist()
OTHER = np.random.default_rng(1).integers(3, 40000, 80).tolist()


def _last_logits(runner, steps) -> torch.Tensor:
    """LONG fed to a new sequence in `steps`, each (new tokens' parents or a chunk
    length, other sequences' inputs riding in the same forward): the logits of
    LONG's last position. A step is an int n (the next n tokens as one prompt chunk,
    a decode step when 1) or a list of parents (a tree of LONG's next tokens and, where
    a parent list holds "x", a token of another branch)."""
    n = 0
    seqs = ["s"]
    runner.add_sequence("s")
    out = torch.empty(0)
    try:
        pos = 0
        for step, beside in steps:
            if isinstance(step, int):
                inputs = [SeqInput.chain("s", LONG[pos : pos + step], prefill=step > 1)]
                keep, last = list(range(step)), step - 1
                pos += step
            else:  # (parent, is LONG's next token) per node
                tokens, parents, keep = [], [], []
                for i, (parent, ours) in enumerate(step):
                    tokens.append(LONG[pos] if ours else OTHER[i])
                    parents.append(parent)
                    if ours:
                        keep.append(i)
                        pos += 1
                inputs = [
                    SeqInput("s", np.asarray(tokens, np.int32), np.asarray(parents, np.int32))
                ]
                last = keep[-1]
            for other in beside:
                n += 1
                seqs.append(f"o{n}")
                runner.add_sequence(f"o{n}")
                inputs.append(SeqInput.chain(f"o{n}", OTHER[:other], prefill=other > 1))
            out = runner.forward(inputs)[last]
            runner.commit("s", keep)
        assert pos == len(LONG)
        return out
    finally:
        for sid in seqs:
            runner.free(sid)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_positions_logits_are_the_same_bits_however_the_forward_is_composed(
    activations, stored, exact
):
    """The lossless invariant's premise for the stored target, through the runner: the
    logits of a position are bitwise the same whether its prompt came as one chunk, in
    chunks of other sizes, token by token, beside other sequences, or as a chain or a
    tree node with other branches beside it (prefill chunks went to torch's SDPA, which
    gave a position other bits in a chunk of another length: ~1e-5 apart in float32,
    and with int8 activations, whose rounding turns one ulp into a step of amax / 127,
    logits 0.3-0.5 apart)."""
    runner = stored if activations == "int8" else exact
    with single_thread():
        base = _last_logits(runner, [(70, [])])
        tree = [(-1, True), (0, False), (0, True), (2, False), (2, True), (4, True)]
        for steps in [
            [(32, []), (32, []), (6, [])],
            [(40, []), (30, [])],
            [(69, []), (1, [])],
            [(60, [])] + [(1, [])] * 10,
            [(66, []), ([(-1, True), (0, True), (1, True), (2, True)], [])],
            [(66, []), (tree, [])],
            [(70, [45])],
            [(50, [3, 77]), (20, [1])],
            [(66, [9]), (tree, [33, 1])],
        ]:
            got = _last_logits(runner, steps)
            assert torch.equal(got, base), (steps, (got - base).abs().max().item())


def test_settings_resolve_and_refuse(tiny_llama_dir):
    assert gguf_source(_dir()) == embedded_gguf().resolve()
    assert gguf_source(tiny_llama_dir) is None
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_quantization("auto", _dir(), cpu, f32, 1, "auto") == "stored"
    assert resolve_quantization("auto", _dir(), cpu, f32, 1, "mkl") == "none"
    assert resolve_quantization("auto", _dir(), cpu, f32, 2, "auto") == "none"
    assert resolve_quantization("auto", tiny_llama_dir, cpu, f32, 1, "auto") == "none"
    assert resolve_quantization("int8", tiny_llama_dir, cpu, f32, 1, "auto") == "int8"
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_quantization("stored", tiny_llama_dir, cpu, f32, 1, "auto")
    with pytest.raises(ValueError, match="tensor parallelism"):
        resolve_quantization("stored", _dir(), cpu, f32, 2, "auto")
    with pytest.raises(ValueError, match="float32"):
        resolve_quantization("stored", _dir(), cpu, torch.bfloat16, 1, "auto")
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_quantization("int3", _dir(), cpu, f32, 1, "auto")
    assert load_settings(None).model.quantization == "auto"


def test_the_choice_is_logged_and_exported(stored, caplog):
    from adaserve import metrics
    from adaserve.engine_build import report_quantization

    with caplog.at_level("INFO"):
        assert report_quantization("target", stored) == "stored"
    assert "target weights: stored (120 Q4_1, 1 Q8_0 layers)" in caplog.text
    gauge = metrics.model_quantization.labels(role="target", quantization="stored")
    assert gauge._value.get() == 1.0


def _dir() -> Path:
    from adaserve.model.embedded import resolve_model

    return resolve_model("embedded")


MAX_TOKENS = 20


@pytest.mark.slow
def test_speculation_on_the_stored_target_is_lossless(stored):
    """Through the engine under the CPU config (shipped int8 drafter), one request and
    three: the stored target's own plain greedy tokens; and seeded samples with and
    without speculation are the same tokens."""
    tok = load_tokenizer("embedded")
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
    prompts = {f"p{k}": tok(t)["input_ids"] for k, t in enumerate(texts)}
    config = Path(__file__).parents[1] / "configs" / "embedded-cpu.yaml"
    settings = load_settings(config, slo={"baseline_tpot_ms": 50.0})
    with single_thread():
        ref, _ = generate(stored, prompts, MAX_TOKENS)
        draft = load_runner(
            "embedded", device="cpu", role="drafter", kv_blocks=128, quantization="int8"
        )
        engine = Engine(
            RunnerTarget(stored, eos_token_ids=()),
            BeamDrafter(draft),
            LocalScheduler(settings.scheduler),
            settings,
        )
        for batch in (["p1"], ["p0", "p1", "p2"]):
            streams = [
                engine.submit(
                    GenerationRequest(
                        k,
                        tuple(prompts[k]),
                        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                        tpot_slo_ms=[40.0, 100.0, 400.0][i],
                    )
                )
                for i, k in enumerate(batch)
            ]
            assert run_to_completion(engine, streams)["tokens"] == {k: ref[k] for k in batch}

        sps = {
            "p0": SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS),
            "p1": SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=MAX_TOKENS),
            "p2": SamplingParams(max_tokens=MAX_TOKENS),  # greedy beside sampled ones
        }

        def run(**kw):
            rngs = {i: TokenRng(sp.seed) for i, sp in sps.items() if sp.seed is not None}
            return generate(stored, prompts, MAX_TOKENS, sp=sps, rngs=rngs, **kw)

        plain, _ = run()
        spec, stats = run(drafter=BeamDrafter(draft), depth=3, width=2, budget=random_budget)
        assert spec == plain and sum(stats.accepted) > 0
        assert stored.kv_usage() == 0.0 and draft.kv_usage() == 0.0


@pytest.mark.slow
def test_a_k_quant_files_layers_are_served_as_stored(tmp_path, monkeypatch):
    """A GGUF with Q4_K and Q6_K tensors (the embedded file, its down projections
    re-quantized here): they are served as stored beside the Q4_1 ones, checked at load
    against the conversion, and with float32 activations the logits are the float32
    (`none`) model's of that file bit for bit."""
    monkeypatch.setenv("ADASERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = embedded_gguf()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    n = with_k_quant_down_projections(src, model_dir / src.name)
    assert n == 30
    with single_thread():
        stored_runner = load_runner(
            str(model_dir / src.name),
            device="cpu",
            kv_blocks=64,
            quantization="stored",
            stored_activations="float32",
        )
        none_runner = load_runner(
            str(model_dir / src.name), device="cpu", kv_blocks=64, quantization="none"
        )
        formats = {"Q4_1": 90, "Q4_K": 15, "Q6_K": 15, "Q8_0": 1}
        assert stored_runner.weight_formats == formats
        assert torch.equal(logits_of(stored_runner, PROMPT), logits_of(none_runner, PROMPT))
