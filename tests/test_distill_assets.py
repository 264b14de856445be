"""The drafter directory format: export, completion from the target
(adaserve/model/draft_assets.py), the runtime loading it, and the shipped drafter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from adaserve.distill.export import export_drafter, load_drafter, quantize_int8_rowwise
from adaserve.distill.weights import init_student, load_teacher, trainable_state
from adaserve.model import draft_assets
from adaserve.model.embedded import DRAFTER_ASSET as ASSET
from adaserve.model.embedded import EAGLE_ASSET
from adaserve.model.loader import load_tokenizer
from tests._stats import single_thread


@pytest.fixture()
def exported(tiny_llama_dir: Path, tmp_path: Path):
    teacher = load_teacher(tiny_llama_dir)
    student = init_student(teacher, 1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in student.layers.parameters():  # differ from the teacher's layer 0
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    d2t = torch.tensor([255, 3, 7, 100, 42, 0], dtype=torch.int64)
    export_drafter(
        trainable_state(student), d2t, tiny_llama_dir, str(tiny_llama_dir), tmp_path / "d"
    )
    return teacher, student, d2t, tmp_path / "d"


def test_export_stores_only_trained_weights(exported) -> None:
    _, _, d2t, out = exported
    state = load_file(str(out / "model.safetensors"))
    assert not any("embed_tokens" in k or "lm_head" in k for k in state)
    assert all(v.dtype == torch.float16 for v in state.values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["adaserve_format_version"] == 1 and cfg["adaserve_embeddings_from"] == "target"
    assert load_file(str(out / "draft_vocab.safetensors"))["d2t"].tolist() == d2t.tolist()
    assert not list(out.glob("tokenizer*"))  # the target's tokenizer serves the drafter


def test_shipped_drafters_hold_no_tokenizer() -> None:
    """A drafter shares its target's vocabulary, so its tokenizer is the target's, kept
    once with the target; the shipped drafter directories hold none of their own."""
    for asset in (ASSET, EAGLE_ASSET):
        files = {f.name for f in asset.iterdir()}
        assert {"config.json", "model.safetensors", "draft_vocab.safetensors"} <= files
        assert not files & {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def test_roundtrip_logits(exported) -> None:
    teacher, student, d2t, out = exported
    loaded, head, d2t2 = load_drafter(out)  # finds the target through adaserve_target
    assert d2t2.tolist() == d2t.tolist()
    torch.testing.assert_close(head, teacher.embed_tokens.weight[d2t])
    ids = torch.tensor([[5, 9, 13, 200]])
    with torch.no_grad(), single_thread():
        ref = student.logits(student(ids), teacher.embed_tokens.weight[d2t])
        got = loaded.logits(loaded(ids), head)
    torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)  # fp16 storage


def test_runtime_runner_matches(exported) -> None:
    """The serving runtime loads the exported directory through the hook and agrees."""
    from adaserve.model.loader import load_runner
    from adaserve.model.runner import SeqInput

    _, _, d2t, out = exported
    loaded, head, _ = load_drafter(out)
    runner = load_runner(out, "cpu", "float32", role="drafter", kv_blocks=8, kv_block_size=4)
    assert runner.draft_to_target.tolist() == d2t.tolist()
    runner.add_sequence("s")
    ids = [5, 9, 13, 200]
    with single_thread():
        got = runner.forward([SeqInput.chain("s", ids)])
        with torch.no_grad():
            ref = loaded.logits(loaded(torch.tensor([ids])), head)[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_int8_rowwise(tiny_llama_dir: Path, exported, tmp_path: Path) -> None:
    _, student, d2t, out = exported
    w = torch.randn(16, 32)
    q = quantize_int8_rowwise({"x.weight": w, "n.weight": torch.ones(32)})
    assert q["x.weight"].dtype == torch.int8 and q["x.weight_scale"].shape == (16,)
    back = draft_assets.dequantize(q)
    assert set(back) == {"x.weight", "n.weight"}
    assert (back["x.weight"] - w).abs().max() <= w.abs().max() / 127
    export_drafter(
        trainable_state(student),
        d2t,
        tiny_llama_dir,
        str(tiny_llama_dir),
        tmp_path / "q",
        weight_format="int8_rowwise",
    )
    assert (tmp_path / "q" / "model.safetensors").stat().st_size < (
        out / "model.safetensors"
    ).stat().st_size
    a, head, _ = load_drafter(out)
    b, _, _ = load_drafter(tmp_path / "q")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(
            b.logits(b(ids), head), a.logits(a(ids), head), atol=0.05, rtol=0.05
        )


def test_wrong_target_and_bad_files_are_clear_errors(exported, tmp_path: Path) -> None:
    from tests.conftest import make_tiny_model

    _, _, _, out = exported
    other = make_tiny_model(
        tmp_path / "wide",
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="wrong target"):
        draft_assets.complete_state_dict(out, cfg, state, other)
    with pytest.raises(ValueError, match="give the target"):
        draft_assets.complete_state_dict(out, {**cfg, "adaserve_target": None}, state)
    with pytest.raises(ValueError, match="version"):
        draft_assets.complete_state_dict(out, {**cfg, "adaserve_format_version": 2}, state)
    plain = {"model_type": "llama"}
    assert draft_assets.complete_state_dict(out, plain, state) == (state, None)


@pytest.mark.slow
def test_shipped_drafter(embedded_dir: Path) -> None:
    """The committed drafter: small, complete, loads against the embedded target, and
    agrees with it on a short held-out continuation."""
    from adaserve.distill import measure
    from adaserve.distill.data import Sequences
    from adaserve.distill.generate import generate_all

    cfg = json.loads((ASSET / "config.json").read_text())
    assert sum(f.stat().st_size for f in ASSET.iterdir()) < 20_000_000
    assert (ASSET / "MODEL_CARD.md").is_file()
    assert cfg["adaserve_target"] == "embedded"
    student, head, d2t = load_drafter(ASSET, embedded_dir)
    assert len(d2t) == cfg["adaserve_draft_vocab_size"]
    teacher = load_teacher(embedded_dir)
    tok = load_tokenizer(embedded_dir)  # the target's: the drafter shares its vocabulary
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that adds two numbers."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    with single_thread():
        conts = generate_all(teacher, [prompt], 24, [tok.eos_token_id], 1)
        acc = measure.summarize(
            measure.draft_matches(student, head, d2t, Sequences.build([prompt], conts)), 4
        )
    assert acc.top1_agreement > 0.3 and np.isfinite(acc.mean_emitted)
