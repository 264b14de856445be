"""benchmarks/peers/run.py: the table and JSON it writes (issue 32). The smoke run starts
adaserve all-in-one on the embedded model; llama.cpp is not needed (its row says why)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers.run import FIXED_CHAIN, SERVERS

REPO = Path(__file__).parents[1]
RUN = REPO / "benchmarks" / "peers" / "run.py"


def test_build_script_is_keyed_by_version() -> None:
    text = (REPO / "benchmarks" / "peers" / "build_llamacpp.sh").read_text()
    for flag in ("-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release"):
        assert flag in text
    assert "peers/llama.cpp-${VERSION}" in text and "--no-binary :all:" in text


@pytest.mark.slow
def test_smoke_run_writes_the_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "peers"
    r = subprocess.run(
        [sys.executable, str(RUN), "--smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    md = (out / "peers.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| server"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols == [
        "server",
        "layout",
        "tok/s @1 (x llama)",
        "tok/s @2 (x llama)",
        "attainment @0.5 rps (cod/chat/sum)",
        "goodput @0.5 rps tok/s",
    ]
    assert "AMD" in md or "Intel" in md or "cores" in md  # the machine is named
    data = json.loads((out / "peers.json").read_text())
    assert {"date", "commit", "machine", "command", "settings", "rows"} <= set(data)
    assert data["machine"]["cores"] and "isa" in data["machine"]
    rows = {row["server"]: row for row in data["rows"]}
    assert list(rows) == list(SERVERS)  # every server has a row, in order
    aio = rows["adaserve-aio"]
    assert aio["status"] == "ok", aio
    assert aio["tok_s"]["1"] > 0 and aio["tok_s"]["2"] > 0
    run = aio["rates"]["0.5"]
    assert run["requests"] >= 1 and run["errors"] == 0
    assert set(run["per_class"]) <= {"coding", "chat", "summarization"}
    assert rows["llama-server"]["status"].startswith("skipped")
    assert (out / "adaserve-aio" / "rps0.5" / "summary.json").is_file()


def test_the_fixed_chain_server_is_the_simulators_spec_2(monkeypatch) -> None:
    # adaserve-chain's environment over the shipped config: every request drafted 2
    # tokens deep by the model drafter, all verified (policy global, a budget no batch
    # reaches), as policies.py's spec-2.
    from adaserve.config import load_settings
    from adaserve.sim.policies import policy_spec

    for k, v in FIXED_CHAIN.items():
        monkeypatch.setenv(k, v)
    s = load_settings(REPO / "configs" / "embedded-cpu.yaml")
    spec2 = policy_spec("spec-2", s.engine.max_running).overrides["scheduler"]
    assert s.scheduler.policy == spec2["policy"] == "global"
    assert s.scheduler.budget >= spec2["budget"]
    a = s.scheduler.adaptive
    assert (a.policy, a.fixed_depth, a.fixed_width) == ("fixed", 2, 1)
    assert s.speculation.default_method == "model"
    # Its drafter reads whole prompts, as spec-2's (the window is adaserve's).
    assert policy_spec("spec-2", 64).overrides["speculation"]["draft_context"] is None
    assert s.speculation.draft_context >= 10**9


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1"}
