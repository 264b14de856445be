"""benchmarks/bench_features.py: its summary arithmetic, and its --smoke run against the
real all-in-one CPU server (every variant once, JSON outputs validated)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling _server.py
    try:
        spec = importlib.util.spec_from_file_location("bench_features", BENCH / "bench_features.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


def test_ratios_are_per_round_and_speculation_per_drafted_tree(bench) -> None:
    rates = {"plain": [10.0, 20.0, 30.0], "json_schema": [5.0, 20.0, 15.0]}
    spec = {"json_schema": {"drafts": 10.0, "emitted": 25.0, "drafted": 20.0, "accepted": 15.0}}
    plain, js = bench.summarize(rates, spec)
    assert plain["ratio_to_plain_median"] == 1.0 and plain["tokens_per_verification"] is None
    assert js["ratio_to_plain_median"] == 0.5  # median of 0.5, 1.0, 0.5
    assert js["tokens_per_s_median"] == 15.0
    assert js["tokens_per_verification"] == 2.5 and js["draft_acceptance"] == 0.75


@pytest.mark.slow  # starts the all-in-one server with the embedded SmolLM2 pair
def test_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    run = subprocess.run(
        [sys.executable, str(BENCH / "bench_features.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert {r["variant"] for r in res["rows"]} == {
        "plain",
        "logprobs (top 5)",
        "penalties",
        "logit_bias + min_p",
        "json_schema",
    }
    assert all(r["tokens_per_s_median"] > 0 for r in res["rows"])
    assert res["json_valid"][0] == res["json_valid"][1] == 1
