"""The distillation Llama against transformers: dense forward, cached left-padded
generation, greedy continuations and their recorded top-k."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaserve.distill.generate import generate_all, generate_batch
from adaserve.distill.weights import init_layer_indices, init_student, load_teacher, trainable_state
from tests._stats import single_thread


@pytest.fixture(scope="module")
def pair(tiny_llama_dir: Path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, local_files_only=True).eval()
    return hf, load_teacher(tiny_llama_dir)


def test_dense_forward_matches_transformers(pair) -> None:
    hf, me = pair
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), single_thread():
        ref = hf(ids).logits
        got = me.logits(me(ids))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("static", [False, True])
def test_greedy_generation_matches_transformers(pair, static: bool) -> None:
    """Left padding, the KV cache and positions are right: every row of a ragged batch
    continues exactly as transformers' greedy generate does for it alone. `static` is the
    fixed-shape step a GPU replays from a CUDA graph (here run eagerly)."""
    hf, me = pair
    prompts = [[5, 9, 200, 3], [17], [44, 45, 46, 47, 48, 49, 50]]
    with single_thread():
        outs = generate_batch(me, prompts, max_new_tokens=6, eos_ids=[255], static=static)
        for p, o in zip(prompts, outs, strict=True):
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=255,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            assert o.tokens == ref[: len(o.tokens)]
            assert len(o.tokens) == 6 or o.tokens[-1] == 255


@pytest.mark.parametrize("static", [False, True])
def test_topk_is_the_targets_distribution(pair, static: bool) -> None:
    hf, me = pair
    prompt = [3, 1, 4, 1, 5]
    with single_thread():
        (out,) = generate_batch(me, [prompt], max_new_tokens=3, eos_ids=[255], static=static)
        seq = torch.tensor([prompt + out.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(hf(seq).logits[0, len(prompt) - 1 : -1], -1)
    assert out.topk_ids.shape == (3, 32) and out.topk_ids.dtype == torch.int32
    assert out.topk_ids[:, 0].tolist() == out.tokens  # greedy: the chosen token is the top-1
    ref = logp.gather(-1, out.topk_ids.long())
    torch.testing.assert_close(out.topk_logp.float(), ref, atol=2e-3, rtol=1e-3)


def test_generate_all_keeps_prompt_order_and_stops_at_deadline(pair) -> None:
    _, me = pair
    prompts = [[1] * n for n in (3, 8, 1, 5)]
    with single_thread():
        outs = generate_all(me, prompts, 2, [255], batch_size=2)
        alone = [generate_batch(me, [p], 2, [255])[0].tokens for p in prompts]
        assert [o.tokens for o in outs] == alone
        assert generate_all(me, prompts, 2, [255], batch_size=2, deadline=0.0) == [None] * 4


def test_sampling_is_seeded(pair) -> None:
    _, me = pair
    with single_thread():
        a = generate_all(me, [[1, 2, 3]] * 3, 5, [255], 3, temperature=1.0, seed=7)
        b = generate_all(me, [[1, 2, 3]] * 3, 5, [255], 3, temperature=1.0, seed=7)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert len({tuple(x.tokens) for x in a}) > 1  # rows draw independently


def test_student_init_copies_teacher_layers(tiny_llama_dir: Path) -> None:
    teacher = load_teacher(tiny_llama_dir)
    assert init_layer_indices(1, 30) == [0]
    assert init_layer_indices(2, 30) == [0, 29]
    assert init_layer_indices(4, 30) == [0, 10, 19, 29]
    with pytest.raises(ValueError):
        init_layer_indices(3, 2)
    student = init_student(teacher, 1)
    assert student.embed_tokens is teacher.embed_tokens
    assert not student.embed_tokens.weight.requires_grad
    torch.testing.assert_close(
        student.layers[0].mlp.up_proj.weight, teacher.layers[0].mlp.up_proj.weight
    )
    assert all(p.requires_grad for p in student.layers.parameters())
    assert not any(k.startswith("embed_tokens") for k in trainable_state(student))
