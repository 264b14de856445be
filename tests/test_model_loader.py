"""Model resolution and loading: local directories only, sharded checkpoints, clear
errors for missing or unsupported models, distilled-drafter directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from adaserve.model.build import resolve_dtype
from adaserve.model.config import ModelConfig, UnsupportedModelError
from adaserve.model.embedded import ModelNotFoundError, resolve_model
from adaserve.model.loader import load_runner
from adaserve.model.runner import SeqInput
from tests.conftest import make_tiny_model


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    runner = load_runner(path, "cpu", "float32", kv_blocks=32, kv_block_size=4)
    runner.add_sequence("s")
    return runner.forward([SeqInput.chain("s", ids)])


def test_missing_path_names_it() -> None:
    with pytest.raises(ModelNotFoundError, match=r"/no/such/model.*never downloaded"):
        resolve_model("/no/such/model")
    with pytest.raises(FileNotFoundError):  # ModelNotFoundError is one
        load_runner("/no/such/model")


def test_not_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"no config\.json"):
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"must be \.gguf"):
        resolve_model(tmp_path / "weights.bin")


def test_unsupported_architecture_names_path_and_arch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModelError, match=f"{tmp_path}.*GPT2LMHeadModel"):
        load_runner(tmp_path, "cpu")


def test_unsupported_rope_and_sliding_window(tiny_llama_dir: Path, tmp_path: Path) -> None:
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict(raw, source="x")
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32)
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        load_runner(tmp_path / "m", "cpu", kv_blocks=32, kv_block_size=4)  # 128 > 32
    runner = load_runner(tmp_path / "m", "cpu", kv_blocks=32, kv_block_size=4, max_model_len=32)
    assert runner.max_model_len == 32


def test_sharded_checkpoint_matches_single(tiny_llama_untied_dir: Path, tmp_path: Path) -> None:
    state = load_file(str(tiny_llama_untied_dir / "model.safetensors"))
    names = sorted(state)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(tiny_llama_untied_dir / "config.json", out)
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / file))
        weight_map.update({k: file for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.testing.assert_close(_logits(out, ids), _logits(tiny_llama_untied_dir, ids))
    (out / "b.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match=r"shard\(s\) missing: b.safetensors"):
        load_runner(out, "cpu", kv_blocks=8)


def test_config_reads_eos_from_both_files(tiny_llama_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.num_heads // cfg.num_kv_heads == 2
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw["eos_token_id"] = 2
    cfg = ModelConfig.from_dict(raw, generation={"eos_token_id": [2, 7]})
    assert cfg.eos_token_ids == (2, 7)


def test_dtype_resolution() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", torch.device("cpu"))


def test_bfloat16_runs_close_to_float32(tiny_llama_dir: Path) -> None:
    ids = [5, 6, 7, 8]
    runner = load_runner(tiny_llama_dir, "cpu", "bfloat16", kv_blocks=8, kv_block_size=4)
    runner.add_sequence("s")
    got = runner.forward([SeqInput.chain("s", ids)])
    assert got.dtype == torch.float32  # logits are always float32
    torch.testing.assert_close(got, _logits(tiny_llama_dir, ids), atol=0.15, rtol=0.05)


def test_distilled_drafter_borrows_target_embedding(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The draft_assets.py format: no embedding in the drafter, a reduced draft vocab
    whose LM head rows are the target's embedding rows d2t."""
    student = make_tiny_model(tmp_path / "student", "llama", seed=5, num_hidden_layers=1)
    state = load_file(str(student / "model.safetensors"))
    state.pop("model.embed_tokens.weight")
    state.pop("lm_head.weight", None)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    save_file(state, str(drafter / "model.safetensors"))
    d2t = torch.tensor([7, 3, 200, 0, 42], dtype=torch.int64)
    save_file({"d2t": d2t}, str(drafter / "draft_vocab.safetensors"))
    raw = json.loads((student / "config.json").read_text())
    raw.update(
        adaserve_format_version=1,
        adaserve_embeddings_from="target",
        adaserve_target=str(tiny_llama_dir),
        adaserve_draft_vocab="draft_vocab.safetensors",
    )
    (drafter / "config.json").write_text(json.dumps(raw))

    runner = load_runner(drafter, "cpu", "float32", role="drafter", kv_blocks=8, kv_block_size=4)
    assert runner.draft_to_target is not None
    assert runner.draft_to_target.tolist() == d2t.tolist()
    ids = [9, 8, 7]
    runner.add_sequence("s")
    got = runner.forward([SeqInput.chain("s", ids)])
    assert got.shape == (3, 5)

    # Oracle: the student with the target's embedding and the head rows picked by d2t.
    hf = AutoModelForCausalLM.from_pretrained(student, local_files_only=True).eval()
    embed = load_file(str(tiny_llama_dir / "model.safetensors"))["model.embed_tokens.weight"]
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(embed)
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    ref = hidden @ embed[d2t].T
    np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=1e-4)


def test_embedded_drafter_hook() -> None:
    """`embedded` as a drafter is the shipped distilled drafter, or a clear error."""
    from adaserve.model.embedded import DRAFTER_ASSET

    if (DRAFTER_ASSET / "config.json").is_file():
        assert resolve_model("embedded", role="drafter") == DRAFTER_ASSET
    else:
        with pytest.raises(ModelNotFoundError, match="no trained drafter"):
            resolve_model("embedded", role="drafter")
    with pytest.raises(ValueError, match="role"):
        resolve_model("embedded", role="critic")
