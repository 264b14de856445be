"""Tensor parallelism with real processes (gloo on CPU): TP=2 and TP=4 give the logits
of TP=1 through prefill, a token tree, a commit of a branch and decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.model.kv_cache import KVCacheFull
from adaserve.model.loader import load_runner
from adaserve.model.runner import SeqInput

pytestmark = pytest.mark.slow

KV = {"kv_blocks": 32, "kv_block_size": 4}


def _script(runner) -> list[torch.Tensor]:
    """Two sequences through prefill, a ragged tree batch, commits and a decode step."""
    rng = np.random.default_rng(0)
    out = []
    for sid, n in (("a", 11), ("b", 6)):
        runner.add_sequence(sid)
        out.append(runner.forward([SeqInput.chain(sid, rng.integers(0, 256, n))]))
        runner.commit(sid, range(n))
    trees = [
        SeqInput(
            "a", rng.integers(0, 256, 5).astype(np.int32), np.array([-1, 0, 0, 1, 2], np.int32)
        ),
        SeqInput("b", rng.integers(0, 256, 2).astype(np.int32), np.array([-1, 0], np.int32)),
    ]
    out.append(runner.forward(trees))
    runner.commit("a", [0, 2, 4])
    runner.commit("b", [0])
    out.append(runner.forward([SeqInput.chain("a", [5]), SeqInput.chain("b", [6])], last_only=True))
    out.append(torch.tensor([runner.committed_len("a"), runner.committed_len("b")]))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_process(tiny_llama_untied_dir: Path, tp: int) -> None:
    want = _script(load_runner(tiny_llama_untied_dir, "cpu", "float32", **KV))
    runner = load_runner(tiny_llama_untied_dir, "cpu", "float32", tp=tp, **KV)
    try:
        got = _script(runner)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        # Errors are raised on rank 0 and the followers stay in step.
        with pytest.raises(KVCacheFull):
            runner.forward([SeqInput.chain("a", list(range(200)))])
        with pytest.raises(ValueError):
            runner.forward([SeqInput.chain("a", [999])])
        runner.free("a")
        runner.free("b")
        assert runner.kv_usage() == 0.0
        runner.add_sequence("c")
        torch.testing.assert_close(
            runner.forward([SeqInput.chain("c", [1, 2, 3])]),
            _single(tiny_llama_untied_dir, [1, 2, 3]),
            atol=1e-5,
            rtol=1e-5,
        )
    finally:
        runner.close()


def test_tp_returns_the_single_process_features(tiny_llama_untied_dir: Path) -> None:
    """An EAGLE drafter's input under tensor parallelism: rank 0's hidden states."""
    one = load_runner(tiny_llama_untied_dir, "cpu", "float32", **KV)
    one.add_sequence("a")
    want = one.forward_features([SeqInput.chain("a", [5, 6, 7, 8])], (0, 1), [3])
    runner = load_runner(tiny_llama_untied_dir, "cpu", "float32", tp=2, **KV)
    try:
        runner.add_sequence("a")
        got = runner.forward_features([SeqInput.chain("a", [5, 6, 7, 8])], (0, 1), [3])
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        assert got[1] is not None and want[1] is not None
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        runner.commit("a", range(4))  # the followers stayed in step
        one.commit("a", range(4))
        torch.testing.assert_close(
            runner.forward([SeqInput.chain("a", [9])]),
            one.forward([SeqInput.chain("a", [9])]),
            atol=1e-5,
            rtol=1e-5,
        )
    finally:
        runner.close()


def test_tp_rejects_indivisible_heads(tiny_llama_dir: Path) -> None:
    with pytest.raises((ValueError, RuntimeError), match="divisible"):
        load_runner(tiny_llama_dir, "cpu", "float32", tp=3, **KV)  # 4 KV heads


def _single(path: Path, ids: list[int]) -> torch.Tensor:
    runner = load_runner(path, "cpu", "float32", **KV)
    runner.add_sequence("c")
    return runner.forward([SeqInput.chain("c", ids)])


def test_tp_engine_prefills_in_chunks_beside_trees_losslessly(tiny_llama_untied_dir: Path) -> None:
    """The unified iteration under TP=2: prompts prefilled in chunks of a few tokens ride
    in the same forwards as the trees of running requests; every output is the target's
    own greedy output (Hugging Face's, no cache)."""
    from adaserve.config import load_settings
    from adaserve.engine import Engine
    from adaserve.runner_target import RunnerTarget
    from adaserve.scheduler import LocalScheduler
    from adaserve.speculate import BeamDrafter
    from tests._engine import hf_greedy, req, run_to_completion

    settings = load_settings(
        None,
        engine={"kv_blocks": 256, "max_batch_tokens": 6, "min_prefill_tokens": 3},
        scheduler={"budget": 12},
    )
    runner = load_runner(tiny_llama_untied_dir, "cpu", "float32", tp=2, kv_blocks=256)
    drafter = BeamDrafter(load_runner(tiny_llama_untied_dir, "cpu", "float32", kv_blocks=256))
    engine = Engine(RunnerTarget(runner, ()), drafter, LocalScheduler(settings.scheduler), settings)
    prompts = [list(range(3, 40)), list(range(50, 95)), [7, 8, 9]]
    try:
        first = [engine.submit(req(0, prompts[0], 20, 30.0))]
        late: list = []

        def arrive(step: int) -> None:
            if step in (8, 11):
                i = 1 + len(late)
                late.append(engine.submit(req(i, prompts[i], 15, 80.0)))

        got = run_to_completion(engine, first, on_step=arrive)["tokens"]
        got |= run_to_completion(engine, late)["tokens"]
        for i, p in enumerate(prompts):
            n = 20 if i == 0 else 15
            assert got[f"r{i}"] == hf_greedy(tiny_llama_untied_dir, p, n), i
        assert runner.kv_usage() == 0.0
    finally:
        runner.close()
