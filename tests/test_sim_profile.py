"""`adaserve profile` on tiny random checkpoints: a loadable profile and a replayable
acceptance trace (timings on a shared CPU are noisy: only their shape is checked)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adaserve.cli import main
from adaserve.sim.acceptance import AcceptanceSettings, build_acceptance, load_trace
from adaserve.sim.costmodel import Surface, load_profile
from adaserve.sim.measure import knee_budget


def _profile_argv(model: Path, out: Path, tokens: str, contexts: str, *extra: str) -> list[str]:
    """`adaserve profile` of a model drafting for itself on a small grid, one rep."""
    return [
        "profile",
        "--target",
        str(model),
        "--drafter",
        str(model),
        "--out",
        str(out),
        "--tokens",
        tokens,
        "--contexts",
        contexts,
        "--reps",
        "1",
        *extra,
    ]


def test_profile_and_trace_from_real_runners(tiny_llama_dir: Path, tmp_path: Path):
    out, trace = tmp_path / "cpu.yaml", tmp_path / "acc.jsonl"
    rc = main(
        _profile_argv(
            tiny_llama_dir,
            out,
            "1,4,8",
            "0,64",
            "--trace",
            str(trace),
            "--trace-steps",
            "3",
            "--quiet",
        )
    )
    assert rc == 0
    p = load_profile(out)
    assert p.name == "cpu" and p.vocab_size == 256
    assert p.verify.tokens == [1, 4, 8] and p.verify.context == [0, 64]
    assert all(m > 0 for row in p.verify.ms for m in row)
    assert p.prefill_ms(100) > 0 and p.draft_ms(4) > 0 and p.baseline_ms() > 0
    assert p.budget in (1, 4, 8)
    # the drafter's chunk forward is measured past the draft-step table's last point,
    # and a chunk there is priced along it
    assert p.draft_prefill is not None and all(m > 0 for m in p.draft_prefill.ms)
    last = p.draft_step.tokens[-1]
    assert p.draft_prefill.tokens[-1] > last
    far = p.draft_prefill.tokens[-1]
    rise = max(p.draft_prefill(far) - p.draft_prefill(last), 0.0)
    assert p.draft_forward_ms(int(far)) == pytest.approx(p.draft_step(last) + rise)
    records = load_trace(trace)
    assert records and all(0 < q <= 1 for r in records for q in r.probs)
    assert any(r.full for r in records)
    cal, draft = build_acceptance(AcceptanceSettings(mode="replay", trace=str(trace)))
    rng = np.random.default_rng(0)
    assert np.all((cal(np.linspace(0, 1, 11), rng) >= 0) & (cal(np.linspace(0, 1, 11), rng) <= 1))
    assert draft(3, 2, rng).shape == (3, 2)


def test_profile_of_int4_weights_as_served(tiny_llama_dir: Path, tmp_path: Path, caplog):
    """`--quantization int4 --drafter-quantization int4 --stored-activations int8`
    profiles the runners as `model.quantization: int4` serves them (Q4_1 blocks on the
    packed kernel, int8 activations); the profile loads."""
    from adaserve.model.cpu_gemm import packed_kernel_available

    if not packed_kernel_available():
        pytest.skip("int4 needs the packed CPU kernel")
    out = tmp_path / "int4.yaml"
    argv = _profile_argv(tiny_llama_dir, out, "1,4", "0", "--quiet")
    argv += ["--quantization", "int4", "--drafter-quantization", "int4"]
    with caplog.at_level("INFO"):
        assert main([*argv, "--stored-activations", "int8"]) == 0
    swapped = "int4 weights: 8 Q4_1, 1 Q8_0 linear layers (packed CPU kernel, int8 activations)"
    assert caplog.text.count(swapped) == 2  # the target and the drafter
    assert load_profile(out).verify.tokens == [1, 4]


def test_knee_budget():
    s = Surface(tokens=[1, 16, 64, 128, 256], ms=[[30, 32, 40, 58, 90]])
    assert knee_budget(s) == 128


def test_profile_bad_model(tmp_path: Path, capsys):
    rc = main(
        [
            "profile",
            "--target",
            str(tmp_path / "missing"),
            "--drafter",
            "none",
            "--out",
            str(tmp_path / "p.yaml"),
        ]
    )
    assert rc == 2
    assert "missing" in capsys.readouterr().err


def test_random_trace_prompts_match_bench_serve_range():
    from adaserve.sim.record import prompt_ids

    class Tok:  # a tokenizer is ignored when random ids are asked for
        def encode(self, text: str) -> list[int]:
            raise AssertionError("tokenizer used")

    prompts = prompt_ids(Tok(), 49152, 5, random_ids=(1000, 20000), length=12)
    assert len(prompts) == 5 and all(len(p) == 12 for p in prompts)
    assert all(1000 <= t < 20000 for p in prompts for t in p)
    assert prompts == prompt_ids(None, 49152, 5, random_ids=(1000, 20000), length=12)
    # a range beyond the vocabulary is clipped to it
    assert all(t < 256 for p in prompt_ids(None, 256, 3, random_ids=(10, 20000)) for t in p)


def test_profile_bad_random_range(tiny_llama_dir: Path, tmp_path: Path, capsys):
    rc = main(
        _profile_argv(
            tiny_llama_dir,
            tmp_path / "p.yaml",
            "1,2",
            "0",
            "--trace",
            str(tmp_path / "t.jsonl"),
            "--trace-random-prompts",
            "5",
            "--quiet",
        )
    )
    assert rc == 2
    assert "LO,HI" in capsys.readouterr().err


def test_profile_random_range_beyond_the_vocabulary(tiny_llama_dir: Path, tmp_path: Path, capsys):
    argv = _profile_argv(
        tiny_llama_dir,
        tmp_path / "p.yaml",
        "1",
        "0",
        "--trace",
        str(tmp_path / "t.jsonl"),
        "--trace-random-prompts",
        "300,400",
    )
    assert main(argv) == 2  # the tiny model has 256 tokens
    assert "vocabulary" in capsys.readouterr().err
