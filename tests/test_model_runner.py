"""ModelRunner against Hugging Face transformers (the oracle): prefill chains, decode,
token trees spread over several forwards, batches of ragged trees, and commits of
non-trivial chains. fp32, atol 1e-4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from adaserve.model.kv_cache import KVCacheFull
from adaserve.model.loader import load_runner
from adaserve.model.runner import ModelRunner, SeqInput

ATOL = 1e-4


def _runner(path: Path, **kw) -> ModelRunner:
    kw = {"kv_blocks": 128, "kv_block_size": 4, **kw}
    return load_runner(path, "cpu", "float32", **kw)


def _hf(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def _hf_last(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_llama_dir",
        "tiny_llama_untied_dir",
        "tiny_llama3_dir",
        "tiny_qwen2_dir",
        "tiny_mistral_dir",
    ],
)
def test_chain_logits_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    runner, hf = _runner(path), _hf(path)
    ids = np.random.default_rng(1).integers(0, 256, 40)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0]
    runner.add_sequence("s")
    parts = []
    for a, b in [(0, 23), (23, 24), (24, 31), (31, 40)]:  # prefill, decode, chunks
        parts.append(runner.forward([SeqInput.chain("s", ids[a:b])]))
        runner.commit("s", range(b - a))
    got = torch.cat(parts)
    assert got.dtype == torch.float32 and got.shape == (40, 256)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert runner.committed_len("s") == 40


def test_tree_over_several_forwards_matches_hf(tiny_llama3_dir: Path) -> None:
    runner, hf = _runner(tiny_llama3_dir), _hf(tiny_llama3_dir)
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 256, 13).tolist()
    runner.add_sequence("s")
    runner.forward([SeqInput.chain("s", prefix)])
    runner.commit("s", range(len(prefix)))
    # Beam-search shape: root, then layers added one forward at a time, siblings included.
    calls = [[-1], [0, 0, 0], [1, 1, 3], [4, 6, 5, 4]]
    parents: list[int] = []
    tokens: list[int] = []
    for call in calls:
        toks = rng.integers(0, 256, len(call)).tolist()
        logits = runner.forward([SeqInput("s", np.array(toks, np.int32), np.array(call, np.int32))])
        for j, p in enumerate(call):
            parents.append(p)
            tokens.append(toks[j])
            node = len(parents) - 1
            ref = _hf_last(hf, prefix + [tokens[i] for i in _path(parents, node)])
            torch.testing.assert_close(logits[j], ref, atol=ATOL, rtol=0)
    assert runner.scratch_len("s") == len(parents)


def test_ragged_batch_equals_sequences_alone(tiny_qwen2_dir: Path) -> None:
    runner, hf = _runner(tiny_qwen2_dir), _hf(tiny_qwen2_dir)
    rng = np.random.default_rng(3)
    prefixes = {"a": 5, "b": 17, "c": 1}
    for sid, n in prefixes.items():
        runner.add_sequence(sid)
        toks = rng.integers(0, 256, n)
        runner.forward([SeqInput.chain(sid, toks)])
        runner.commit(sid, range(n))
        prefixes[sid] = toks.tolist()
    trees = {
        "a": [-1, 0, 0, 1, 1, 2],
        "b": [-1],
        "c": [-1, 0, 1, 2, 0],
    }
    inputs = [
        SeqInput(s, rng.integers(0, 256, len(p)).astype(np.int32), np.array(p, np.int32))
        for s, p in trees.items()
    ]
    logits = runner.forward(inputs)
    assert logits.shape == (12, 256)
    row = 0
    for x in inputs:
        par = x.parents.tolist()
        for j in range(len(par)):
            path = [int(x.tokens[i]) for i in _path(par, j)]
            ref = _hf_last(hf, prefixes[x.seq_id] + path)
            torch.testing.assert_close(logits[row], ref, atol=ATOL, rtol=0)
            row += 1


def test_commit_branch_then_continue(tiny_llama_dir: Path) -> None:
    """Keep a chain that is not the first nodes (KV must move down), keep going."""
    runner, hf = _runner(tiny_llama_dir), _hf(tiny_llama_dir)
    rng = np.random.default_rng(4)
    history = rng.integers(0, 256, 9).tolist()
    runner.add_sequence("s")
    runner.forward([SeqInput.chain("s", history)])
    runner.commit("s", range(9))
    for _ in range(6):  # several accept/reject cycles
        parents = [-1, 0, 0, 2, 1, 3, 3]
        toks = rng.integers(0, 256, len(parents)).tolist()
        runner.forward([SeqInput("s", np.array(toks, np.int32), np.array(parents, np.int32))])
        keep = [0, 2, 3, 6][: rng.integers(1, 5)]
        runner.commit("s", keep)
        history += [toks[i] for i in keep]
        assert runner.committed_len("s") == len(history)
        assert runner.scratch_len("s") == 0
    nxt = int(rng.integers(0, 256))
    got = runner.forward([SeqInput.chain("s", [nxt])])[0]
    torch.testing.assert_close(got, _hf_last(hf, [*history, nxt]), atol=ATOL, rtol=0)


def test_logits_for_chosen_rows_only(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir)
    for sid in "ab":
        runner.add_sequence(sid)
    a, b = SeqInput.chain("a", [1, 2, 3]), SeqInput.chain("b", [4, 5])
    full = runner.forward([a, b])
    runner.commit("a", [])
    runner.commit("b", [])
    last = runner.forward([a, b], last_only=True)
    torch.testing.assert_close(last, full[[2, 4]], atol=1e-5, rtol=0)
    runner.commit("a", [])
    runner.commit("b", [])
    picked = runner.forward([a, b], logits_indices=[4, 0])
    torch.testing.assert_close(picked, full[[4, 0]], atol=1e-5, rtol=0)
    runner.commit("a", [])
    runner.commit("b", [])
    with pytest.raises(ValueError, match="logits_indices"):
        runner.forward([a, b], logits_indices=[5])
    assert runner.scratch_len("a") == 0


def test_bad_inputs_are_rejected_without_side_effects(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir, kv_blocks=4, kv_block_size=4, max_model_len=64)
    runner.add_sequence("s")
    with pytest.raises(KeyError, match="unknown sequence"):
        runner.forward([SeqInput.chain("nope", [1])])
    with pytest.raises(ValueError, match="out of range"):
        runner.forward([SeqInput.chain("s", [1, 999])])
    with pytest.raises(ValueError, match="earlier scratch index"):
        runner.forward([SeqInput("s", np.array([1, 2], np.int32), np.array([-1, 1], np.int32))])
    with pytest.raises(ValueError, match="twice"):
        runner.forward([SeqInput.chain("s", [1]), SeqInput.chain("s", [2])])
    with pytest.raises(ValueError, match="already exists"):
        runner.add_sequence("s")
    with pytest.raises(KVCacheFull):
        runner.forward([SeqInput.chain("s", list(range(17)))])  # 16 slots in all
    assert runner.scratch_len("s") == 0 and runner.kv_usage() == 0.0
    runner.forward([SeqInput.chain("s", [1, 2])])
    with pytest.raises(ValueError, match="not a chain"):
        runner.commit("s", [1])
    runner.commit("s", [0, 1])
    assert runner.committed_len("s") == 2
    runner.free("s")
    runner.free("s")  # idempotent
    assert runner.kv_usage() == 0.0


def test_max_model_len_is_enforced(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir, max_model_len=8)
    runner.add_sequence("s")
    with pytest.raises(ValueError, match="max_model_len"):
        runner.forward([SeqInput.chain("s", list(range(9)))])
    runner.forward([SeqInput.chain("s", list(range(8)))])


def test_capacity_accounting(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir, kv_blocks=8, kv_block_size=4, max_model_len=64)
    assert runner.can_allocate(32) and not runner.can_allocate(33)
    assert runner.free_blocks() == 8 and (runner.num_blocks, runner.block_size) == (8, 4)
    runner.add_sequence("s")
    assert runner.blocks_needed({"s": 10}) == 3
    runner.forward([SeqInput.chain("s", list(range(10)))])
    runner.commit("s", range(10))
    assert runner.kv_usage() == 3 / 8 and runner.free_blocks() == 5
    assert runner.blocks_needed({"s": 2}) == 0 and runner.blocks_needed({"s": 3}) == 1
    assert runner.can_allocate(20) and not runner.can_allocate(21)
