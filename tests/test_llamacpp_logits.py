"""adaserve's stored GGUF target against llama.cpp's logits on the same file
(benchmarks/peers/logits_check.py, small: 2 prompts x 8 positions): llama.cpp sees
exactly adaserve's token ids, and with float32 and with int8 activations adaserve's
log-probabilities at llama.cpp's greedy positions are within the check's stated
tolerance, with the same argmax wherever llama.cpp's top two are not near a tie; a
wrong RoPE base fails the same check. Skipped where llama-server is not built (CI
builds none: benchmarks/peers/build_llamacpp.sh)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from adaserve.model.layers import Rotary
from tests._kernels import needs_kernel
from tests._stats import single_thread

REPO = Path(__file__).parents[1]


def _module():
    spec = importlib.util.spec_from_file_location(
        "logits_check", REPO / "benchmarks" / "peers" / "logits_check.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["logits_check"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


lc = _module()
SERVER = lc.llama_server_path(lc.DEFAULT_LLAMA_VERSION)
needs_llama = pytest.mark.skipif(
    not SERVER.is_file(),
    reason=f"llama-server not built ({SERVER}; benchmarks/peers/build_llamacpp.sh)",
)


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> list:
    args = lc.parse_args(["--prompts", "2", "--positions", "8"])
    texts = lc.prompt_texts(args.prompts)
    log = tmp_path_factory.mktemp("llama") / "server.log"
    refs, isa = lc.llama_references(args, texts, lc.tokenize(texts), log)
    assert isa != "unknown", "the server logged no system_info line"
    return refs


def _logprobs(mode: str, refs: list) -> list[torch.Tensor]:
    with single_thread(), torch.inference_mode():
        runner = lc.load(mode, threads=1)
        return [lc.teacher_forced(runner, ref) for ref in refs]


@pytest.mark.slow
@needs_llama
@needs_kernel
def test_llama_cpp_sees_our_token_ids_and_answers_greedily(refs) -> None:
    """Both sides start from the same ids (llama_reference raises if the server
    evaluated another number of prompt tokens, e.g. a prepended BOS), llama.cpp's
    tokenizer would have made those ids from the text too, and at temperature 0 each
    generated token is the top of llama.cpp's own pre-sampling list."""
    assert [r.name for r in refs] == ["chat-code", "chat-science"]
    for ref in refs:
        assert ref.tokenizer_agrees
        assert len(ref.tokens) == len(ref.top) == 8
        assert all(len(top) == 10 for top in ref.top)
        assert ref.tokens == [top[0][0] for top in ref.top]
        for top in ref.top:  # log-probabilities, best first
            lps = [lp for _, lp in top]
            assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)


@pytest.mark.slow
@needs_llama
@needs_kernel
@pytest.mark.parametrize("mode", ["stored-f32", "stored-int8"])
def test_stored_target_matches_llama_cpp_within_the_tolerance(refs, mode: str) -> None:
    res = lc.judge(lc.compare(mode, refs, _logprobs(mode, refs)), lc.TOLERANCE)
    tol = lc.TOLERANCE
    assert res.positions == 16
    assert res.max_abs <= tol.max_abs, res
    assert res.median_abs <= tol.median_abs, res
    # a disagreement only at a near tie, and at most a few of those
    assert all(m["gap"] < tol.tie for m in res.mismatches), res.mismatches
    assert res.agree >= 14, res.mismatches
    assert res.passed


@pytest.mark.slow
@needs_llama
@needs_kernel
def test_a_wrong_rope_base_fails_the_check(refs) -> None:
    """The tolerance is loose enough for 8-bit activation noise, not for a real error:
    RoPE with base 1e4 instead of the file's 1e5 (all else exact) fails it."""
    with single_thread(), torch.inference_mode():
        runner = lc.load("stored-f32", threads=1)
        model = runner.model
        assert model.cfg.rope_theta == 1e5
        cpu = torch.device("cpu")
        model.rotary = Rotary(
            model.cfg.head_dim, 1e4, model.rotary.max_len, None, torch.float32, cpu
        )
        lps = [lc.teacher_forced(runner, ref) for ref in refs]
    res = lc.judge(lc.compare("stored-f32", refs, lps), lc.TOLERANCE)
    assert not res.passed
    assert res.median_abs > lc.TOLERANCE.median_abs, res


@pytest.mark.slow
@needs_llama
@needs_kernel
def test_the_check_as_a_script(tmp_path: Path) -> None:
    """--smoke end to end: exit 0 and the JSON report."""
    out = tmp_path / "logits.json"
    assert lc.main(["--smoke", "--modes", "stored-int8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["tolerance"] == asdict(lc.TOLERANCE)
    assert [r["mode"] for r in data["results"]] == ["stored-int8"]
    assert data["results"][0]["passed"] is True
    assert data["llama_system_info"] != "unknown" and data["machine"]["cpu"]


def test_judge_reads_every_bound() -> None:
    """Each bound alone fails a result (runs without llama.cpp)."""
    tol = lc.Tolerance(max_abs=1.0, median_abs=0.1, tie=0.5)

    def res(**kw) -> bool:
        r = lc.ModeResult("m", max_abs=0.5, median_abs=0.05, **kw)
        return lc.judge(r, tol).passed

    assert res()
    assert res(mismatches=[{"gap": 0.4}])
    assert not res(mismatches=[{"gap": 0.6}])
    assert not lc.judge(lc.ModeResult("m", max_abs=1.1, median_abs=0.05), tol).passed
    assert not lc.judge(lc.ModeResult("m", max_abs=0.5, median_abs=0.2), tol).passed
