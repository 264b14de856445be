"""The load test's short form (benchmarks/load_test.py has the full one: 200 clients for
60 s): streaming clients against the all-process deployment (`adaserve up`), every
stream checked token for token against the target's greedy output, no 5xx, and every
process's memory reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._serving import REPO

pytestmark = pytest.mark.slow  # four serving processes and ~10 s of load


def test_short_load_run(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "load_test.py"),
            *("--clients", "12", "--duration", "10", "--max-tokens", "24"),
            *("--work-dir", str(tmp_path / "work"), "--json", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["server_errors"] == 0 and rep["failures"] == {}
    assert rep["requests"] >= 12 and rep["correct"] == rep["requests"]
    assert rep["statuses"] == {"200": rep["requests"]}
    assert rep["tokens"] == 24 * rep["requests"]
    assert set(rep["memory_mb"]) == {"scheduler", "drafter-0", "verifier-0", "gateway", "launcher"}
    assert rep["ttft_ms"]["p99"] >= rep["ttft_ms"]["p50"] > 0
    assert rep["tpot_ms"]["p99"] >= rep["tpot_ms"]["p50"] > 0
    # 12 clients under the default budget of 16: speculation really runs.
    assert rep["engine"]["spec_accepted_tokens"] > 0
