"""Weight-only int4 for any float32 target or drafter (`model.quantization: int4`,
`model.drafter_quantization: int4`; adaserve/model/stored.py `serve_int4`): Q4_1 blocks
made at load and served by the stored-weights kernel. The blocks hold the weights within
the quantizer's derived error; the model keeps no float32 weight matrix; its logits are,
bit for bit, those of a float32 checkpoint holding the blocks' dequantized values (an
independent dequantize-then-matmul reference, whose greedy tokens Hugging Face's own
forward reproduces); re-quantizing the embedded Q4_1 model gives back its file's blocks;
and speculation on an int4 target (with an int4 drafter too) emits that target's own
greedy tokens and seeded samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from adaserve import metrics
from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.engine_build import build_drafter, report_quantization
from adaserve.model.cpu_gemm import QuantEmbedding, QuantLinear
from adaserve.model.loader import load_runner
from adaserve.model.stored import Q4_1, Q8_0, quantize_blocks, resolve_quantization
from adaserve.request import SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.sampling import TokenRng
from adaserve.scheduler import LocalScheduler
from tests._engine import PROMPTS, hf_greedy, make_engine, req, run_to_completion
from tests._kernels import logits_of, needs_kernel
from tests._spec_loop import generate, random_budget
from tests._stats import single_thread
from tests.conftest import make_tiny_model

pytestmark = needs_kernel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("int4"), "llama", seed=5)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("int4-untied"), "llama", seed=6, tie_word_embeddings=False
    )


def _roundtrip(w: torch.Tensor, kind: int) -> torch.Tensor:
    """w's dequantized blocks, by the gguf package's dequantizer."""
    raw = quantize_blocks(w, kind).numpy()
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType(kind)).astype(np.float32))


def _dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the Hugging Face model in `src` whose linear weights are their Q4_1
    blocks' values and whose LM head and embedding are their Q8_0 blocks' values."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2:
                continue
            kind = Q8_0 if ("embed_tokens" in name or "lm_head" in name) else Q4_1
            p.copy_(_roundtrip(p, kind))
    model.save_pretrained(dst)
    for f in src.glob("tokenizer*"):
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_blocks_hold_the_weights_within_the_quantizers_error():
    """Q4_1 per 32 weights: q = round((w - min) / d) with d = (max - min) / 15, stored
    as q * d16 + m16 (float16 scale and minimum), so |w - w'| <= d / 2 + 15 |d - d16| +
    |m - m16| <= d / 2 + (15 d + |min|) 2^-11, plus float32 rounding of the products."""
    rng = np.random.default_rng(0)
    w = torch.from_numpy(rng.standard_normal((48, 96)).astype(np.float32) * 0.3)
    got = _roundtrip(w, Q4_1)
    groups, back = w.view(-1, 32), got.view(-1, 32)
    lo, hi = groups.min(1).values, groups.max(1).values
    d = (hi - lo) / 15
    bound = d / 2 + (15 * d + lo.abs()) * 2.0**-11 + 1e-6
    err = (groups - back).abs().amax(1)
    assert (err <= bound).all(), (err - bound).max()
    assert (err > 0).any()  # 4 bits do not hold random weights exactly
    q8 = _roundtrip(w, Q8_0).view(-1, 32)  # q = round(w / d), d = max |w| / 127
    d8 = groups.abs().amax(1) / 127
    assert ((groups - q8).abs().amax(1) <= d8 / 2 + groups.abs().amax(1) * 2.0**-11).all()


@pytest.mark.parametrize("fixture,tied", [("model_dir", True), ("untied_dir", False)])
def test_an_int4_model_is_its_blocks_and_keeps_no_float32_matrix(request, fixture, tied, tmp_path):
    """2 layers x (qkv, o, gate_up, down) in Q4_1 and the LM head in Q8_0; the embedding
    reads the head's blocks (tied) or its own; only norms stay float32. With float32
    activations the logits are those of the dequantized checkpoint served by the float32
    packed kernel, bit for bit (dequantization is exact and the FMA chains are the
    same), and that checkpoint's greedy tokens are Hugging Face's."""
    path = request.getfixturevalue(fixture)
    ref_dir = _dequantized_checkpoint(path, tmp_path / "deq")
    with single_thread():
        int4 = load_runner(
            path, device="cpu", kv_blocks=64, quantization="int4", stored_activations="float32"
        )
        ref = load_runner(ref_dir, device="cpu", kv_blocks=64, quantization="none")
        assert int4.quantization == "int4" and ref.quantization == "none"
        assert int4.weight_formats == {"Q4_1": 8, "Q8_0": 1}
        model = int4.model
        assert isinstance(model.embed, QuantEmbedding)
        assert (model.embed.head is model.lm_head) == tied
        assert all(p.dim() == 1 for p in model.parameters())  # norms only
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert {m.activations for m in layers} == {"float32"}
        for prompt in PROMPTS[:3]:
            assert torch.equal(logits_of(int4, prompt), logits_of(ref, prompt))
        assert generate(int4, {"p": PROMPTS[1]}, 16)[0]["p"] == hf_greedy(ref_dir, PROMPTS[1], 16)


def test_int4_of_the_embedded_model_gives_back_its_files_blocks():
    """The embedded SmolLM2's float32 weights are its GGUF's Q4_1 (layers) and Q8_0 (tied
    head) values; quantizing them again by the same reference quantizer finds each
    block's own scale and minimum, so `int4` serves the file's blocks: the `stored`
    model's logits, bit for bit, under either activation mode."""
    prompt = [1, 504, 3458, 282, 1167, 314, 253, 1123, 30, 2, 9, 47]
    with single_thread():
        for activations in ("float32", "int8"):
            got, want = (
                logits_of(
                    load_runner(
                        "embedded",
                        device="cpu",
                        kv_blocks=32,
                        quantization=q,
                        stored_activations=activations,
                    ),
                    prompt,
                )
                for q in ("int4", "stored")
            )
            assert torch.equal(got, want), activations


def test_settings_resolve_report_and_refuse(model_dir, caplog):
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_quantization("int4", model_dir, cpu, f32, 1, "auto") == "int4"
    # a GPU box runs the same settings file unquantized, and says so
    for q in ("int4", "int8"):
        assert resolve_quantization(q, model_dir, torch.device("cuda"), f32, 1, "auto") == "none"
    for args, why in [
        ((cpu, f32, 2, "auto"), "tensor parallelism"),
        ((cpu, torch.bfloat16, 1, "auto"), "float32"),
        ((cpu, f32, 1, "mkl"), "packed CPU kernel"),
    ]:
        with pytest.raises(ValueError, match=f"int4: .*{why}"):
            resolve_quantization("int4", model_dir, *args)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        resolve_quantization("int3", model_dir, cpu, f32, 1, "auto")
    assert load_settings(None, model={"quantization": "int4"}).model.quantization == "int4"
    with single_thread():
        runner = load_runner(model_dir, device="cpu", kv_blocks=16, quantization="int4")
    with caplog.at_level("INFO"):
        assert report_quantization("target", runner) == "int4"
    assert "target weights: int4 (8 Q4_1, 1 Q8_0 layers)" in caplog.text


MAX_TOKENS = 24


def test_speculation_on_an_int4_target_with_an_int4_drafter_is_lossless(model_dir):
    """The int4 target's own plain greedy tokens through the engine, with the drafter
    the same model run as int4 from the settings (`model.drafter_quantization: int4`)
    but on float32 activations, so its trees differ from the target's choices now and
    then; and
    seeded samples with and without speculation are the same tokens."""
    settings = load_settings(
        None,
        model={"drafter": str(model_dir), "drafter_quantization": "int4", "device": "cpu"},
        engine={"kv_blocks": 256, "kv_block_size": 16, "max_queue": 64},
        scheduler={"budget": 12, "policy": "equal"},
    )
    prompts = {f"r{i}": PROMPTS[i] for i in range(4)}
    with single_thread():
        target = load_runner(
            model_dir, device="cpu", kv_blocks=256, quantization="int4", stored_activations="int8"
        )
        drafter = build_drafter(settings)
        assert drafter.runner.quantization == "int4"
        plain, _ = generate(target, prompts, MAX_TOKENS)
        engine = Engine(
            RunnerTarget(target, eos_token_ids=()),
            drafter,
            LocalScheduler(settings.scheduler),
            settings,
        )
        streams = [engine.submit(req(i, PROMPTS[i], MAX_TOKENS, 1e4)) for i in range(4)]
        assert run_to_completion(engine, streams)["tokens"] == plain

        sps = {
            "r0": SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS),
            "r1": SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=MAX_TOKENS),
            "r2": SamplingParams(max_tokens=MAX_TOKENS),
            "r3": SamplingParams(temperature=1.3, top_k=20, seed=3, max_tokens=MAX_TOKENS),
        }

        def run(**kw):
            rngs = {i: TokenRng(sp.seed) for i, sp in sps.items() if sp.seed is not None}
            return generate(target, prompts, MAX_TOKENS, sp=sps, rngs=rngs, **kw)

        sampled, _ = run()
        spec, stats = run(drafter=drafter, depth=3, width=2, budget=random_budget)
        assert spec == sampled and sum(stats.accepted) > 0


def test_int4_under_chunked_prefill_preemption_and_prefix_reuse(model_dir):
    """The int4 target and int4 drafter from the settings, on requests that share a
    48-token start (the first served alone, so the others find it in the prefix cache;
    the last resends the first one's history): with ample KV and whole prompts, and with
    8 KV blocks (the three later requests cannot all hold their KV: preempted and
    recomputed) and 16-token forwards (prompts prefilled in chunks). Every output is the
    int4 target's own plain greedy continuation."""
    start = list(range(10, 58))
    own = [[3, 4, 5], [9, 9, 9, 9, 9, 9, 9], [200]]
    with single_thread():
        plain_target = load_runner(
            model_dir, device="cpu", kv_blocks=64, quantization="int4", stored_activations="int8"
        )
        first = generate(plain_target, {"r0": [*start, *own[0]]}, 20)[0]["r0"]
        prompts = [[*start, *o] for o in own] + [[*start, *own[0], *first, 11, 12]]
        later = {f"r{i}": p for i, p in enumerate(prompts) if i}
        want = {"r0": first[:12], **generate(plain_target, later, 20)[0]}
        outs, preempted, hits = [], [], []
        for kv, tokens in ((512, 512), (8, 16)):
            engine = make_engine(
                model_dir,
                model_dir,
                model={
                    "quantization": "int4",
                    "drafter_quantization": "int4",
                    "stored_activations": "int8",
                },
                engine={"kv_blocks": kv, "kv_watermark": 0.0, "max_batch_tokens": tokens},
                scheduler={"policy": "equal"},
            )
            p0, h0 = metrics.preemptions_total._value.get(), metrics.prefix_cache_hits._value.get()
            out = run_to_completion(engine, [engine.submit(req(0, prompts[0], 12, 1e4))])
            streams = [engine.submit(req(i, p, 20, 1e4)) for i, p in enumerate(prompts) if i]
            outs.append({**out["tokens"], **run_to_completion(engine, streams)["tokens"]})
            preempted.append(metrics.preemptions_total._value.get() - p0)
            hits.append(metrics.prefix_cache_hits._value.get() - h0)
            assert engine.target.kv_usage() == 0.0
    assert all(out == want for out in outs)
    assert preempted[0] == 0 and preempted[1] > 0 and all(h > 0 for h in hits)
