"""`adaserve simulate`: the command contract, sweeps and bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from adaserve.cli import main
from adaserve.sim.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def workload_file(tmp_path: Path) -> Path:
    data = {
        "name": "tiny",
        "profile": "llama-3.1-70b-tp4-a100",
        "rps": 2.0,
        "duration_s": 5.0,
        "classes": {
            "coding": {
                "weight": 0.6,
                "slo": {"baseline_scale": 1.2},
                "prompt_tokens": {"dist": "constant", "mean": 100},
                "output_tokens": {"dist": "constant", "mean": 20},
            },
            "summarization": {
                "weight": 0.4,
                "slo": {"tpot_ms": 150},
                "prompt_tokens": {"dist": "constant", "mean": 500},
                "output_tokens": {"dist": "constant", "mean": 15},
            },
        },
        "settings": {"engine": {"max_running": 8}, "scheduler": {"budget": 32}},
        "sweeps": {"fixed_rps": 2.0, "duration_s": 4.0},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_single_run_writes_the_contracted_summary(workload_file, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(
        [
            "simulate",
            str(workload_file),
            "--policy",
            "adaserve",
            "--rps",
            "2.5",
            "--duration",
            "5",
            "--seed",
            "7",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == "adaserve" and s["rps"] == 2.5 and s["seed"] == 7
    assert 0.0 <= s["slo_attainment"] <= 1.0 and s["goodput"] >= 0.0
    assert s["mean_accepted"] >= 1.0
    assert set(s["per_class"]) == {"coding", "summarization"}
    for c in s["per_class"].values():
        assert {"slo_attainment", "goodput", "tpot_p50_ms", "tpot_p90_ms"} <= set(c)
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == s["requests"] > 0
    assert (out / "latency.png").stat().st_size > 1000
    assert "attainment" in capsys.readouterr().out


def test_policy_paper_simulates(workload_file, tmp_path):
    out = tmp_path / "paper"
    args = ["--rps", "2", "--duration", "4", "--out", str(out), "--no-plots", "--quiet"]
    assert main(["simulate", str(workload_file), "--policy", "paper", *args]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == "paper" and s["requests"] > 0 and s["mean_accepted"] >= 1.0


def test_spec_k_and_settings_overrides(workload_file, tmp_path):
    out = tmp_path / "spec"
    rc = main(
        [
            "simulate",
            str(workload_file),
            "--policy",
            "spec",
            "--k",
            "3",
            "--rps",
            "2",
            "--duration",
            "4",
            "--out",
            str(out),
            "--set",
            "engine.max_running=4",
            "--no-plots",
            "--quiet",
        ]
    )
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == "spec-3" and s["mean_batch"] <= 4
    assert not (out / "latency.png").exists()


@pytest.mark.parametrize(
    ("kind", "values"), [("rps", "1,3"), ("urgent", "0.2,0.8"), ("slo-scale", "0.8,1.4")]
)
def test_sweeps_write_csv_and_plots(workload_file, tmp_path, kind, values):
    out = tmp_path / kind
    rc = main(
        [
            "simulate",
            str(workload_file),
            "--sweep",
            kind,
            "--values",
            values,
            "--policies",
            "adaserve,cb",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    name = kind.replace("-", "_")
    rows = list(csv.DictReader((out / f"sweep_{name}.csv").open()))
    assert [(r["x"], r["policy"]) for r in rows] == [
        (x, p) for x in values.split(",") for p in ("adaserve", "cb")
    ]
    assert {"slo_attainment", "goodput", "coding_slo_attainment", "coding_tpot_p90_ms"} <= set(
        rows[0]
    )
    for suffix in ("attainment", "goodput", "per_class"):
        assert (out / f"sweep_{name}_{suffix}.png").stat().st_size > 1000
    assert len(json.loads((out / f"sweep_{name}.json").read_text())) == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "vllm"], "unknown policy"),
        (["--policy", "spec"], "--k"),
        ([], "--policy is required"),
        (["--policy", "cb", "--rps", "-1"], "rps"),
        (["--policy", "cb", "--set", "oops"], "KEY=VALUE"),
        (["--policy", "cb", "--phase-window", "0"], "phase window"),
        (["--sweep", "rps", "--phase-window", "1"], "single runs"),
    ],
)
def test_bad_input_is_a_clear_error(workload_file, tmp_path, capsys, args, message):
    rc = main(["simulate", str(workload_file), "--out", str(tmp_path / "x"), *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_phase_windows_in_the_summary(workload_file, tmp_path):
    out = tmp_path / "run"
    args = ["simulate", str(workload_file), "--policy", "adaserve", "--out", str(out)]
    assert main([*args, "--no-plots", "--quiet", "--phase-window", "0.5"]) == 0
    s = json.loads((out / "summary.json").read_text())
    windows = s["phase_windows"]["windows"]
    assert s["phase_windows"]["window_s"] == 0.5 and windows[1]["t_s"] == 0.5
    assert sum(w["iterations"] for w in windows) == s["iterations"] > 0
    assert sum(w["verify_ms"] for w in windows) == pytest.approx(s["verify_ms_total"])


def test_missing_workload(tmp_path, capsys):
    assert (
        main(["simulate", str(tmp_path / "nope.yaml"), "--policy", "cb", "--out", str(tmp_path)])
        == 2
    )
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((ROOT / "workloads").glob("*.yaml")))
def test_shipped_workloads_load(path):
    wl = load_workload(path)
    from adaserve.sim.driver import workload_profile

    assert workload_profile(wl).name
    assert sum(c.weight for c in wl.classes.values()) == pytest.approx(1.0)
