"""EAGLE head training side: features captured while generating, the training-time-test
unroll against literal drafting, exact chain acceptance, and `adaserve distill --kind
eagle` end to end on a tiny model (export per the contract, resume, measure)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from adaserve.cli import main as cli_main
from adaserve.distill.data import Sequences
from adaserve.distill.eagle_data import build_features
from adaserve.distill.eagle_head import EagleHead, init_head
from adaserve.distill.eagle_measure import (
    chain_walk,
    eagle_matches,
    measure_eagle,
    reference_chain,
)
from adaserve.distill.generate import generate_batch
from adaserve.distill.llama import LlamaModel, LlamaShape
from adaserve.distill.weights import load_teacher
from tests._distill import fake_prompts
from tests._stats import single_thread


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops in loops: an intra-op pool on a shared CPU only adds barrier waits."""
    with single_thread():
        yield


SHAPE = LlamaShape(
    vocab=48, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8, rope_theta=1e4, eps=1e-5
)


def _random_pair(seed: int = 0) -> tuple[LlamaModel, EagleHead]:
    torch.manual_seed(seed)
    target = LlamaModel(SHAPE, 3)
    for p in target.parameters():
        p.data.normal_(0, 0.3)
    head = init_head(target, 2, (0, 2), 2)
    for p in head.parameters():
        if p.requires_grad:
            p.data.add_(torch.randn_like(p) * 0.3)
    return target.eval(), head.eval()


def test_features_captured_while_generating_equal_a_prefill() -> None:
    target, _ = _random_pair()
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    outs = generate_batch(target, prompts, 5, eos_ids=[47], feature_layers=(0, 2))
    for p, o in zip(prompts, outs, strict=True):
        seq = torch.tensor([p + o.tokens])
        _, feats = target.forward_features(seq, (0, 2))
        assert o.features is not None
        assert o.features.shape == (len(p) + len(o.tokens) - 1, 2 * SHAPE.hidden)
        _assert_same_in_float16(o.features, feats[0, :-1])
    # one zero row per sequence end, rows in Sequences' flat order
    flat = build_features(outs, 2 * SHAPE.hidden)
    seqs = Sequences.build(prompts, outs)
    assert len(flat) == len(seqs.tokens)
    assert not flat[seqs.offsets[1] - 1].any()


def _assert_same_in_float16(captured: torch.Tensor, reference: torch.Tensor) -> None:
    """`captured` (float16) is `reference` (float32, computed another way) rounded to
    float16, up to the rounding itself.

    Generation computes each row in a one-token step over the KV cache, the reference in
    one prefill: the same sums in another order (other GEMM shapes, another kernel per
    ISA), so the float32 values differ by reassociation, a few float32 ulps of the sums'
    magnitudes. Rounding to float16 then lands on the same value or, where the two
    straddle a rounding boundary, on neighbouring float16 values: one float16 ulp apart.
    So each element may differ by one float16 ulp of its magnitude plus the float32
    reassociation error (16 float32 ulps of the magnitude: a generous bound for sums of
    32-64 products of O(1) terms)."""
    ref = reference.float()
    mag = torch.maximum(captured.float().abs(), ref.abs())
    exponent = torch.floor(torch.log2(mag.clamp_min(2.0**-14)))  # float16 normals from 2^-14
    ulp16 = torch.exp2(exponent - 10)  # float16: 10 fraction bits
    reassoc = 16 * torch.finfo(torch.float32).eps * mag
    err = (captured.float() - ref).abs()
    bad = err > ulp16 + reassoc
    assert not bad.any(), (
        f"{int(bad.sum())} elements off by more than one float16 ulp: max {err.max()}"
    )


@torch.no_grad()
def test_unroll_is_literal_drafting() -> None:
    """Step j of `unroll` at root r + j is the j-th node of a chain drafted one node at a
    time from root r (inputs past r: the true token and the parent's h), for every
    root and every `start`."""
    target, head = _random_pair(1)
    ids = torch.randint(0, SHAPE.vocab, (1, 14))
    _, feats = target.forward_features(ids, (0, 2))
    g = head.fused(feats[0])
    prev = torch.cat([g.new_zeros(1, SHAPE.hidden), g[:-1]])
    for start in (0, 3, 6):
        hs = head.unroll(ids, feats, 4, start)
        for root in range(start, 10):
            x = head.inputs(ids[0, : root + 1], prev[: root + 1])[None]
            for j in range(4):
                h = head.run(x)[0, -1]
                got = hs[0][0, root] if j == 0 else hs[j][0, root + j - start]
                torch.testing.assert_close(got, h, atol=1e-4, rtol=1e-4)
                x = torch.cat([x, head.inputs(ids[0, root + 1 + j][None], h[None])[None]], 1)


def test_chain_walk_by_hand() -> None:
    t, f = True, False
    # continuation of 6 tokens; row j = draft j's match from each point
    # a continuation of 6 tokens; m[j, i]: draft j from the point with i tokens committed.
    # From 0: m[0, 0] right, m[1, 0] wrong: accept 1, emit 2. From 2: m[0, 2], m[1, 2]
    # right, m[2, 2] wrong: accept 2, emit 3. From 5: m[0, 5] right, nothing after: emit 1.
    m = np.array(
        [
            [t, f, t, t, f, t],
            [f, t, t, f, f, f],
            [t, t, f, f, f, f],
            [t, t, t, f, f, f],
        ]
    )
    assert chain_walk(m, 4) == 3
    assert chain_walk(np.ones((4, 10), bool), 4) == 2  # 5 + 5
    assert chain_walk(np.zeros((4, 3), bool), 4) == 3  # bonus only
    assert chain_walk(np.ones((2, 6), bool), 2) == 2  # depth 2: 3 + 3


@torch.no_grad()
def test_exact_steps_equal_a_drafting_loop() -> None:
    """eagle_matches' step count against a verifier loop that drafts each chain node by
    node (reference_chain) and accepts the matching run plus the bonus; on sequences
    that follow the head's own chains, so runs are long and every depth is exercised."""
    target, head = _random_pair(2)
    d2t = torch.arange(SHAPE.vocab)
    lm = target.embed_tokens.weight.detach()
    rng = np.random.default_rng(0)
    prompts, conts = [], []
    for _ in range(6):
        seq = [int(x) for x in rng.integers(0, SHAPE.vocab, 4)]
        pl = len(seq)
        while len(seq) < 18:  # mostly the head's own drafts, sometimes a random token
            ids = torch.tensor(seq)
            _, f = target.forward_features(ids[None], (0, 2))
            chain = reference_chain(head, lm, d2t, ids, f[0], 3)
            take = int(rng.integers(1, 4))
            seq += [*chain[:take], int(rng.integers(0, SHAPE.vocab))]
        prompts.append(seq[:pl])
        conts.append(seq[pl:])
    flat, offsets, feats = [], [0], []
    for p, c in zip(prompts, conts, strict=True):
        ids = torch.tensor([p + c])
        _, f = target.forward_features(ids, (0, 2))
        flat += p + c
        offsets.append(len(flat))
        feats.append(f[0].half().numpy())
    k = 2
    n_cont = sum(len(c) for c in conts)
    data = Sequences(
        np.asarray(flat, np.int32),
        np.asarray(offsets, np.int64),
        np.asarray([len(p) for p in prompts], np.int32),
        np.zeros((n_cont, k), np.int32),
        np.zeros((n_cont, k), np.float16),
    )
    all_feats = np.concatenate(feats)
    matches, steps = eagle_matches(head, lm, d2t, data, all_feats, 4)
    for i, (p, c) in enumerate(zip(prompts, conts, strict=True)):
        seq = p + c
        ids = torch.tensor(seq)
        f = torch.from_numpy(feats[i].astype(np.float32))
        pos, count, first = len(p) - 1, 0, []
        while pos < len(seq) - 1:
            chain = reference_chain(head, lm, d2t, ids[: pos + 1], f[: pos + 1], 4)
            acc = 0
            while acc < 4 and pos + 1 + acc < len(seq) and chain[acc] == seq[pos + 1 + acc]:
                acc += 1
            pos += min(acc + 1, len(seq) - 1 - pos)
            count += 1
        for q in range(len(p) - 1, len(seq) - 1):
            first.append(
                reference_chain(head, lm, d2t, ids[: q + 1], f[: q + 1], 1)[0] == seq[q + 1]
            )
        assert steps[i] == count
        assert matches[i].tolist() == first
    assert max(len(c) / s for c, s in zip(conts, steps, strict=True)) > 2.0  # long runs seen


def test_distill_eagle_end_to_end(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    work, out = tmp_path / "work", tmp_path / "eagle"
    fake_prompts(work)
    args = [
        "distill",
        "--kind",
        "eagle",
        "--target",
        str(tiny_llama_dir),
        "--out",
        str(out),
        "--work-dir",
        str(work),
        "--feature-layers",
        "0,1",
        "--steps",
        "4",
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
        "--sample-passes",
        "0",
        "--device",
        "cpu",
    ]
    assert cli_main(args) == 0
    assert "eagle: top-1" in capsys.readouterr().out
    assert sorted(p.name for p in work.glob("feat_*")) == [
        "feat_greedy.safetensors",
        "feat_heldout.safetensors",
        "feat_writer.safetensors",
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["adaserve_drafter_kind"] == "eagle"
    assert cfg["adaserve_eagle_feature_layers"] == [0, 1]
    assert cfg["adaserve_eagle_target_layers"] == 2
    assert cfg["num_hidden_layers"] == 1 and cfg["adaserve_weight_format"] == "int8_rowwise"
    assert cfg["adaserve_embeddings_from"] == "target" and cfg["adaserve_draft_vocab_size"] == 64
    assert cfg["vocab_size"] == 256
    state = load_file(str(out / "model.safetensors"))
    h, inter, q, kv = 64, 128, 8 * 8, 4 * 8  # tiny: 8 heads of 8, 4 KV heads
    shapes = {
        "eagle.fc.weight": (h, 2 * h),
        "eagle.fuse.weight": (h, 2 * h),
        "model.norm.weight": (h,),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (q, h),
        "model.layers.0.self_attn.k_proj.weight": (kv, h),
        "model.layers.0.self_attn.v_proj.weight": (kv, h),
        "model.layers.0.self_attn.o_proj.weight": (h, q),
        "model.layers.0.mlp.gate_proj.weight": (inter, h),
        "model.layers.0.mlp.up_proj.weight": (inter, h),
        "model.layers.0.mlp.down_proj.weight": (h, inter),
    }
    scales = {k + "_scale": (v[0],) for k, v in shapes.items() if len(v) == 2}
    assert {k: tuple(v.shape) for k, v in state.items()} == {**shapes, **scales}
    for k, v in state.items():
        if k in scales:
            assert v.dtype == torch.float16 and bool((v > 0).all())
        elif len(shapes[k]) == 2:  # int8 rows, each scaled so its largest entry is 127
            assert v.dtype == torch.int8 and bool((v.abs().amax(1) == 127).all())
        else:
            assert v.dtype == torch.float16
    assert load_file(str(out / "draft_vocab.safetensors"))["d2t"].shape == (64,)
    report = json.loads((out / "distill_report.json").read_text())
    assert report["steps"] == 4 and report["kind"] == "eagle"
    # the exported (int8) head measures through measure-drafter's eagle path
    held = Sequences.load(work / "gen_heldout.safetensors")
    feats = load_file(str(work / "feat_heldout.safetensors"))["features"].numpy()
    matches, steps = measure_eagle(out, tiny_llama_dir, held, feats, (0, 1), 4)
    assert len(matches) == len(held) and all(s >= 1 for s in steps)
    assert sum(len(m) for m in matches) == sum(len(held.continuation(i)) for i in range(len(held)))
    # a rerun refuses the checkpoint without --resume, continues it with --resume, and
    # refuses other feature layers
    assert cli_main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli_main([*args, "--steps", "6", "--resume"]) == 0
    assert json.loads((out / "distill_report.json").read_text())["steps"] == 6
    assert cli_main([*args, "--steps", "7", "--resume", "--feature-layers", "1"]) == 2
    assert "feature_layers" in capsys.readouterr().err


def test_eagle_training_lowers_the_loss(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from adaserve.distill.eagle_train import EagleTrainer
    from adaserve.distill.generate import generate_all
    from adaserve.distill.train import TrainConfig

    torch.manual_seed(0)
    teacher = load_teacher(tiny_llama_dir)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, 250, 4)] for _ in range(12)]
    conts = generate_all(teacher, prompts, 12, [255], batch_size=12, feature_layers=(0, 1))
    data = Sequences.build(prompts, conts)
    feats = build_features(conts, 2 * 64)
    head = init_head(teacher, 1, (0, 1), 1)
    cfg = TrainConfig(steps=30, batch_tokens=512, max_len=64, lr=3e-3, log_every=1000)
    trainer = EagleTrainer(head, torch.arange(256), data, feats, cfg, 3, tmp_path / "ck.pt")
    first = trainer.train_step(np.arange(len(data)))
    last = trainer.run()
    assert last["loss"] < 0.7 * first["loss"]
    assert {"s0/kl", "s1/kl", "s2/kl"} <= set(last)


@pytest.mark.slow
def test_shipped_eagle_head_measures(tmp_path: Path) -> None:
    """`adaserve measure-drafter --drafter embedded-eagle ngram` on two held-out prompts:
    the shipped head reads the embedded target's features and beats bonus-only."""
    import subprocess
    import sys

    from adaserve.model.embedded import EAGLE_ASSET

    if not (EAGLE_ASSET / "config.json").is_file():
        pytest.skip("no shipped EAGLE head")
    heldout = Path(__file__).parents[1] / "adaserve" / "distill" / "prompts" / "heldout.jsonl"
    rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    picked = [next(r for r in rows if r["category"] == c) for c in ("coding", "chat")]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in picked))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "adaserve",
            "measure-drafter",
            "--drafter",
            "embedded-eagle",
            "ngram",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--cost-steps",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(out.stdout)["drafters"]
    eagle = result["embedded-eagle"]
    assert eagle["kind"] == "eagle" and eagle["tokens"] == result["ngram"]["tokens"] > 0
    assert eagle["mean_emitted"] > 1.3 and eagle["top1_agreement"] > 0.3


@pytest.mark.slow
@torch.no_grad()
def test_trained_head_runs_the_same_in_the_serving_runner(embedded_dir: Path) -> None:
    """The contract from both ends: the shipped head, loaded by the trainer's measuring
    code and by the server's EagleRunner, gives the same h and logits, teacher-forced on
    the target's real features and for a drafted child reading its parent's h."""
    from adaserve.distill.eagle_export import load_eagle
    from adaserve.model.eagle import load_eagle_runner
    from adaserve.model.embedded import EAGLE_ASSET
    from adaserve.model.runner import SeqInput

    if not (EAGLE_ASSET / "config.json").is_file():
        pytest.skip("no shipped EAGLE head")
    head, lm_head, d2t = load_eagle(EAGLE_ASSET, embedded_dir)
    target = load_teacher(embedded_dir)
    tokens = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 314, 1345, 28, 2]
    ids = torch.tensor([tokens])
    _, feats = target.forward_features(ids, head.feature_layers)
    assert feats is not None
    want_h = head.forward(ids, feats)[0]
    want_logits = head.logits(want_h, lm_head)
    runner = load_eagle_runner(EAGLE_ASSET, torch.device("cpu"), torch.float32, kv_blocks=16)
    runner.add_sequence("s", tokens)
    g_prev = torch.cat([torch.zeros(1, feats.shape[2]), feats[0, :-1]])
    logits, h = runner.forward_head([SeqInput.chain("s", tokens)], runner.fuse(g_prev))
    torch.testing.assert_close(h, want_h, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(logits, want_logits, atol=2e-3, rtol=2e-3)
    runner.commit("s", range(len(tokens)))
    kid = int(d2t[logits[-1].argmax()])  # the first draft, as a target token
    got, _ = runner.forward_head(
        [SeqInput("s", np.array([kid], np.int32), np.array([-1], np.int32))], h[-1:]
    )
    x = torch.cat(
        [head.inputs(ids[0], head.fused(g_prev)), head.inputs(torch.tensor([kid]), want_h[-1:])]
    )
    torch.testing.assert_close(
        got[0], head.logits(head.run(x[None])[0, -1], lm_head), atol=2e-3, rtol=2e-3
    )
