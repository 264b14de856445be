"""benchmarks/bench_control_plane.py end to end on tiny random models: real drafter and
scheduler processes on loopback, both wirings, a few iterations; the JSON it writes
has every field the report reads, with finite overheads."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_tiny_model

pytestmark = pytest.mark.slow  # two service processes that import torch

REPO = Path(__file__).resolve().parent.parent


def test_both_wirings_report_finite_overheads(tmp_path: Path) -> None:
    target = make_tiny_model(tmp_path / "target", seed=0)
    drafter = make_tiny_model(tmp_path / "drafter", seed=1)
    out = tmp_path / "out"
    argv = f"--n 2 --iters 3 --warmup 1 --budget 8 --kv-memory-gb 0.01 --out {out}"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_control_plane.py"),
            *argv.split(),
            "--target",
            str(target),
            "--drafter",
            str(drafter),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "of it CPU" in r.stdout and "goal" in r.stdout
    result = json.loads((out / "results.json").read_text())
    assert (out / "control_plane.png").stat().st_size > 0
    rows = {(row["mode"], row["n"]): row for row in result["rows"]}
    assert set(rows) == {("all-in-one", 2), ("grpc", 2)}
    for row in rows.values():
        assert row["iterations"] == 3 and row["errors"] == 0
        for key in ("control", "select", "plan", "step"):
            assert math.isfinite(row[f"{key}_p50_ms"]) and row[f"{key}_p50_ms"] >= 0
            assert row[f"{key}_p90_ms"] >= row[f"{key}_p50_ms"]
    grpc = rows["grpc", 2]
    for key in ("spec_rpc", "select_rpc", "select_local", "rpc", "added", "serde_cpu", "wait"):
        for q in (10, 50, 90):
            assert math.isfinite(grpc[f"{key}_p{q}_ms"]), key
    # a loopback round trip costs something; the server's own compute is subtracted
    assert grpc["spec_rpc_p50_ms"] > 0 and grpc["select_rpc_p50_ms"] > 0
    assert 0 < grpc["client_cpu_p50_ms"] < grpc["rpc_p90_ms"]
    assert rows["all-in-one", 2]["spec_p50_ms"] > 0  # the in-process drafter really ran
    per_n = result["summary"]["per_n"]["2"]
    assert per_n["added_p50_ms"] == grpc["added_p50_ms"]
    assert isinstance(per_n["goal_met"], bool)
    cfg = result["config"]
    assert cfg["drafter"] == str(drafter) and len(cfg["loadavg_before"]) == 3
