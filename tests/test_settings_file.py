"""A settings file with a key no setting has is refused, naming the file and the key:
pydantic would drop it, and the server would run the default without a word."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from adaserve.config import check_keys, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_a_typo_in_a_settings_file_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("scheduler:\n  budget: 8\n  adaptive:\n    dmin: 0\n")
    with pytest.raises(ValueError, match=r"s\.yaml: scheduler\.adaptive\.dmin: no such setting"):
        load_settings(cfg)
    cfg.write_text("schedular:\n  budget: 8\n")
    with pytest.raises(ValueError, match=r"schedular: no such setting .*scheduler"):
        load_settings(cfg)


def test_names_and_aliases_are_accepted(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    # prefill_chunk is max_batch_tokens' earlier name (an alias)
    cfg.write_text("engine:\n  prefill_chunk: 128\nscheduler:\n  adaptive:\n    d_min: 0\n")
    s = load_settings(cfg)
    assert s.engine.max_batch_tokens == 128 and s.scheduler.adaptive.d_min == 0
    check_keys({"scheduler": {"slo_budget": True}, "log_prompts": False})


@pytest.mark.parametrize(
    "path",
    ["configs/embedded-cpu.yaml", "k8s/base/adaserve.yaml", "k8s/overlays/gpu/adaserve.yaml"],
)
def test_the_shipped_settings_files_have_no_unknown_key(path: str) -> None:
    load_settings(ROOT / path)


def test_a_service_says_so_and_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("scheduler:\n  polcy: paper\n")
    r = subprocess.run(
        [sys.executable, "-m", "services.scheduler", "--config", str(cfg), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "scheduler.polcy: no such setting" in r.stderr and "Traceback" not in r.stderr
