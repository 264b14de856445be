"""`benchmarks/gpu/check.sh` (issue 23): its smoke mode runs every measurement on CPU
with tiny shapes and reports all five; the report says what is missing or not met."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import check_report  # noqa: E402

from adaserve.sim.costmodel import load_profile  # noqa: E402

KEYS = ["1_lossless", "2_decode_bound", "3_embedded", "4_verify_curve", "5_breakdown"]


@pytest.mark.slow
def test_check_smoke_runs_every_measurement_on_cpu(tmp_path: Path) -> None:
    from tests._serving import make_served_model

    model = make_served_model(tmp_path / "model")  # tiny: the embedded pair is too slow here
    out = tmp_path / "check"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHON": sys.executable,
    }
    models = ["--target", str(model), "--drafter", str(model)]
    res = subprocess.run(
        ["bash", "benchmarks/gpu/check.sh", "--smoke", "--out", str(out), *models],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = json.loads((out / "check.json").read_text())
    for key in KEYS:
        assert report[key]["status"] != "missing", (key, report[key])
    assert report["1_lossless"]["status"] == "met"  # lossless holds on CPU too
    assert report["meta"]["smoke"] is True
    assert {r["concurrency"] for r in report["3_embedded"]["rows"]} == {1, 2}
    assert all(r["hf_tokens_per_s"] for r in report["3_embedded"]["rows"])
    md = (out / "CHECK.md").read_text()
    assert md.count("\n| ") == 1 + len(KEYS)  # header row + one row per measurement
    assert (out / "run_all" / "RESULTS.md").is_file()
    # The measured profile loads as the simulator's, the drafter's prompt forward in it.
    profile = load_profile(out / "run_all" / "profile.yaml")
    assert profile.draft_prefill is not None
    assert profile.draft_prefill.tokens[-1] > profile.draft_step.tokens[-1]
    assert (out / "embedded" / "RESULTS-embedded.md").is_file()


def _run_all(**sections) -> dict:
    return {"meta": {"device": "x", "smoke": False}, "sections": sections}


def test_report_judges_goals_and_names_what_is_missing(tmp_path: Path) -> None:
    run_all = _run_all(
        correctness={
            "lossless": [{"model": "m", "dtype": "bf16", "drafter": "self", "identical": "6/6"}]
        },
        decode_bound={
            "bandwidth_gbs": 3000.0,
            "rows": [{"batch": 1, "step_ms": 7.0, "x_weight_bound": 1.4}],
            "goal_batch1_within_1.3x": False,
        },
        verifier_curve={"error": "RuntimeError: boom"},
        end_to_end={"skipped": "10s left, need 40"},
    )
    emb_rows = [
        {"dtype": "bf16", "concurrency": n, "plain_tokens_per_s": p, "spec_tokens_per_s": s,
         "speedup": s / p, "hf_tokens_per_s": 100.0, "identical": f"{n}/{n}"}
        for n, p, s in [(1, 520.0, 800.0), (32, 4000.0, 4100.0)]
    ]  # fmt: skip
    (tmp_path / "run_all").mkdir()
    (tmp_path / "embedded").mkdir()
    (tmp_path / "run_all" / "results.json").write_text(json.dumps(run_all))
    emb = {"meta": {}, "rows": emb_rows}
    (tmp_path / "embedded" / "results-embedded.json").write_text(json.dumps(emb))
    argv = sys.argv
    sys.argv = ["check_report.py", "--out", str(tmp_path), "--wall-s", "5"]
    try:
        rc = check_report.main()
    finally:
        sys.argv = argv
    assert rc == 1  # two sections missing
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["1_lossless"]["status"] == "met"
    assert report["2_decode_bound"]["status"] == "not met"
    assert report["3_embedded"]["status"] == "met"
    assert report["4_verify_curve"] == {
        "goal": report["4_verify_curve"]["goal"],
        "status": "missing",
        "why": "RuntimeError: boom",
    }
    assert report["5_breakdown"]["why"] == "10s left, need 40"
    # a speculative run slower than plain at batch 32 fails goal 3
    emb["rows"][1]["speedup"] = 0.9
    (tmp_path / "embedded" / "results-embedded.json").write_text(json.dumps(emb))
    assert check_report.embedded(emb)["status"] == "not met"
    emb["rows"][0]["identical"] = "0/1"
    assert check_report.lossless(run_all, emb)["status"] == "not met"
