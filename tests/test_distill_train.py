"""Distillation: acceptance arithmetic, draft vocabulary, batching, the training loop
(learning, checkpoints, resume) and `adaserve distill` end to end on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.cli import main as cli_main
from adaserve.distill import measure
from adaserve.distill.data import Sequences
from adaserve.distill.generate import Continuation, generate_all
from adaserve.distill.train import TrainConfig, Trainer, collate, lr_factor, make_batches
from adaserve.distill.vocab import (
    continuation_counts,
    coverage,
    expected_counts,
    select_draft_vocab,
)
from adaserve.distill.weights import init_student, load_teacher
from tests._distill import fake_prompts
from tests._stats import single_thread


def test_chain_steps_by_hand() -> None:
    m = np.array
    assert measure.chain_steps(m([True] * 10), 4) == 2  # 5 + 5
    assert measure.chain_steps(m([False] * 3), 4) == 3  # bonus only
    # accept 2, miss -> emit 3; then T,T,T,T accepted + bonus (end) -> 1 step
    assert measure.chain_steps(m([True, True, False, True, True, True, True]), 4) == 2
    assert measure.chain_steps(m([], dtype=bool), 4) == 0
    acc = measure.summarize([m([True] * 10), m([False] * 3)], 4)
    assert acc.tokens == 13 and acc.steps == 5
    assert acc.mean_emitted == pytest.approx(13 / 5)
    assert acc.top1_agreement == pytest.approx(10 / 13)


def test_chain_steps_match_a_simulated_chain() -> None:
    """Against an explicit drafter/verifier loop: draft up to `depth` tokens while they
    match, emit the accepted ones and one target token."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        match = rng.random(rng.integers(1, 40)) < 0.7
        pos, steps = 0, 0
        while pos < len(match):
            accepted = 0
            for j in range(4):
                if pos + j >= len(match) or not match[pos + j]:
                    break
                accepted += 1
            pos = min(pos + accepted + 1, len(match))
            steps += 1
        assert measure.chain_steps(match, 4) == steps


def _seqs(n: int = 12, seed: int = 0, k: int = 4) -> Sequences:
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, 50, rng.integers(1, 6))) for _ in range(n)]
    conts = []
    for _ in range(n):
        m = int(rng.integers(1, 9))
        ids = torch.from_numpy(rng.integers(0, 50, (m, k))).int()
        conts.append(
            type(
                "C",
                (),
                {
                    "tokens": ids[:, 0].tolist(),
                    "topk_ids": ids,
                    "topk_logp": torch.randn(m, k).half(),
                },
            )()
        )
    return Sequences.build(prompts, conts)


def test_sequences_roundtrip_and_concat(tmp_path: Path) -> None:
    a, b = _seqs(5, 0), _seqs(7, 1)
    a.save(tmp_path / "a.safetensors")
    a2 = Sequences.load(tmp_path / "a.safetensors")
    both = Sequences.concat([a2, b])
    assert len(both) == 12
    for i in range(5):
        np.testing.assert_array_equal(both.seq(i), a.seq(i))
    for i in range(7):
        np.testing.assert_array_equal(both.seq(5 + i), b.seq(i))
        r0, r1 = both.cont_offsets[5 + i], both.cont_offsets[6 + i]
        np.testing.assert_array_equal(
            both.topk_ids[r0:r1], b.topk_ids[b.cont_offsets[i] : b.cont_offsets[i + 1]]
        )


def test_collate_rows_line_up_with_trained_positions() -> None:
    data = _seqs(10, 2)
    idx = np.array([3, 7, 1])
    ids, mask, rows = collate(data, idx, max_len=9, device="cpu")
    assert int(mask.sum()) == len(rows)
    # each trained position's label is the continuation token whose top-k row it gets
    labels = torch.roll(ids, -1, dims=1)[mask]
    np.testing.assert_array_equal(labels.numpy(), data.topk_ids[rows.numpy(), 0])
    for r, i in enumerate(idx):  # never trains on prompt tokens, respects max_len
        pl = int(data.prompt_lens[i])
        assert not mask[r, : pl - 1].any()
        assert int(mask[r].sum()) == max(0, min(len(data.seq(i)), 9) - pl)


def test_make_batches_cover_everything_within_budget() -> None:
    lengths = np.random.default_rng(0).integers(1, 100, 500)
    batches = make_batches(lengths, 400, np.random.default_rng(1))
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))
    assert all(len(b) * lengths[b].max() <= 400 for b in batches)


def test_lr_schedule() -> None:
    assert lr_factor(0.0, 0.1, 0.1) < 0.01
    assert lr_factor(0.1, 0.1, 0.1) == pytest.approx(1.0)
    assert lr_factor(1.0, 0.1, 0.1) == pytest.approx(0.1)


def test_draft_vocab_by_frequency() -> None:
    data = _seqs(30, 3)
    counts = continuation_counts(data, 64)
    assert counts.sum() == sum(len(data.continuation(i)) for i in range(len(data)))
    d2t = select_draft_vocab(counts, 10, always=[63])
    assert d2t[0] == 63 and len(set(d2t.tolist())) == 10
    assert coverage(counts, select_draft_vocab(counts, 64, [63])) == pytest.approx(1.0)
    top = np.sort(counts)[::-1][:9].sum()
    assert coverage(counts, d2t) == pytest.approx((top + counts[63]) / counts.sum())
    with pytest.raises(ValueError):
        select_draft_vocab(counts, 65, [])
    # expected counts add the target's top-k mass: every sampled token's row sums to 1
    exp = expected_counts(data, 64)
    assert (exp >= counts).all()
    mass = np.exp(data.topk_logp.astype(np.float32)).sum()
    assert exp.sum() == pytest.approx(counts.sum() + mass, rel=1e-4)


@pytest.fixture(scope="module")
def teacher_data(tiny_llama_dir: Path):
    teacher = load_teacher(tiny_llama_dir)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, rng.integers(2, 8)))) for _ in range(24)]
    with single_thread():
        conts = generate_all(teacher, prompts, 12, [255], batch_size=12)
    return teacher, Sequences.build(prompts, conts)


def test_training_learns_and_resumes(teacher_data, tmp_path: Path) -> None:
    teacher, data = teacher_data
    d2t = torch.arange(256)
    cfg = TrainConfig(steps=30, batch_tokens=128, lr=3e-3, max_len=64, save_every_s=0.0)
    with single_thread():
        student = init_student(teacher, 1)
        held = Sequences.concat([data])
        before = measure.summarize(
            measure.draft_matches(student, teacher.embed_tokens.weight, d2t, held), 4
        )
        trainer = Trainer({"L1": student}, d2t, data, cfg, tmp_path / "ckpt.pt")
        first = trainer.train_step(np.arange(4))["L1/kl"]
        trainer.run()
        after = measure.summarize(
            measure.draft_matches(student, teacher.embed_tokens.weight, d2t, held), 4
        )
        assert after.top1_agreement > before.top1_agreement

        # a new trainer on the same checkpoint continues from its step and weights
        cfg2 = TrainConfig(steps=35, batch_tokens=128, lr=3e-3, max_len=64)
        fresh = init_student(teacher, 1)
        resumed = Trainer({"L1": fresh}, d2t, data, cfg2, tmp_path / "ckpt.pt")
        assert resumed.step == trainer.step
        torch.testing.assert_close(
            fresh.layers[0].mlp.up_proj.weight, student.layers[0].mlp.up_proj.weight
        )
        resumed.run()
        assert resumed.step == 35
        assert resumed.train_step(np.arange(4))["L1/kl"] < first
        with pytest.raises(ValueError, match="students"):
            Trainer({"other": init_student(teacher, 1)}, d2t, data, cfg2, tmp_path / "ckpt.pt")


def _continuation(tokens: list[int]) -> Continuation:
    rows = (len(tokens), 1)
    return Continuation(tokens, torch.zeros(rows, dtype=torch.int32), torch.zeros(rows).half())


def test_draft_matches_reading_a_prompts_tail(teacher_data) -> None:
    # `context`: the drafter reads only the last N prompt tokens, exactly as if the
    # prompts had been cut there (the serving setting speculation.draft_context);
    # a window as long as every prompt changes nothing.
    teacher, data = teacher_data
    d2t, head = torch.arange(256), teacher.embed_tokens.weight
    with single_thread():
        student = init_student(teacher, 1)
        full = measure.draft_matches(student, head, d2t, data)
        wide = measure.draft_matches(student, head, d2t, data, context=64)
        tail = measure.draft_matches(student, head, d2t, data, context=2)
        seqs = [data.seq(i) for i in range(len(data))]
        lens = [int(n) for n in data.prompt_lens]
        cut = Sequences.build(
            [s[max(n - 2, 0) : n].tolist() for s, n in zip(seqs, lens, strict=True)],
            [_continuation(s[n:].tolist()) for s, n in zip(seqs, lens, strict=True)],
        )
        expected = measure.draft_matches(student, head, d2t, cut)
    assert [m.tolist() for m in wide] == [m.tolist() for m in full]
    assert [m.tolist() for m in tail] == [m.tolist() for m in expected]
    assert [m.tolist() for m in tail] != [m.tolist() for m in full]  # prompts of 2-7


def test_train_config_validation() -> None:
    with pytest.raises(ValueError, match="step count or a time budget"):
        TrainConfig()
    with pytest.raises(ValueError, match="batch_tokens"):
        TrainConfig(steps=1, batch_tokens=8, max_len=16)


def test_distill_command_end_to_end(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    work, out = tmp_path / "work", tmp_path / "drafter"
    fake_prompts(work)
    _seqs(3, 5, k=32).save(work / "gen_extra_elsewhere.safetensors")  # generated by another run
    args = [
        "distill",
        "--target",
        str(tiny_llama_dir),
        "--out",
        str(out),
        "--work-dir",
        str(work),
        "--layers",
        "1,2",
        "--steps",
        "6",
        "--batch-size",
        "256",
        "--max-len",
        "64",
        "--draft-vocab",
        "64",
        "--max-new-tokens",
        "8",
        "--heldout-max-new-tokens",
        "8",
        "--gen-batch",
        "8",
        "--device",
        "cpu",
    ]
    assert cli_main(args) == 0
    assert "L1: top-1" in capsys.readouterr().out
    report = json.loads((out / "distill_report.json").read_text())
    assert set(report["students"]) == {"L1", "L2"} and report["steps"] == 6
    assert (
        report["train_sequences"] == 4 + 24 + 24 + 3
    )  # writer texts, greedy, 1 sampled pass, extra
    for name, layers in (("L1", 1), ("L2", 2)):
        cfg = json.loads((out / name / "config.json").read_text())
        assert cfg["num_hidden_layers"] == layers and cfg["adaserve_embeddings_from"] == "target"
        assert cfg["adaserve_draft_vocab_size"] == 64
    # a second run refuses to clobber the checkpoint without --resume, and resumes with it
    assert cli_main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli_main([*args, "--steps", "8", "--resume"]) == 0
    assert json.loads((out / "distill_report.json").read_text())["steps"] == 8


def test_distill_command_bad_target(tmp_path: Path, capsys) -> None:
    assert (
        cli_main(["distill", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    )
    assert "does not exist" in capsys.readouterr().err
