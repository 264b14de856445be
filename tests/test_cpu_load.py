"""Startup warnings for an oversubscribed CPU (adaserve/cpu_load.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from adaserve.cpu_load import CpuState, current, oversubscription
from tests._serving import REPO


def test_an_idle_cpu_with_one_thread_per_core_gets_no_warning() -> None:
    assert oversubscription(CpuState(cores=2, load_1m=0.2, torch_threads=2)) == []
    assert oversubscription(CpuState(cores=16, load_1m=7.9, torch_threads=8), 2) == []


def test_a_busy_cpu_is_named_with_its_load_and_what_to_do() -> None:
    (warning,) = oversubscription(CpuState(cores=2, load_1m=3.4, torch_threads=2))
    assert "load average 3.4" in warning and "2 usable core(s)" in warning
    assert "taskset" in warning and "OMP_NUM_THREADS" in warning
    assert oversubscription(CpuState(cores=16, load_1m=8.0, torch_threads=1)) != []


def test_more_torch_threads_than_cores_suggests_a_thread_count() -> None:
    (warning,) = oversubscription(CpuState(cores=2, load_1m=0.0, torch_threads=2), 2)
    assert "4 threads on 2 core(s)" in warning and "OMP_NUM_THREADS=1" in warning
    (warning,) = oversubscription(CpuState(cores=8, load_1m=0.0, torch_threads=8), 3)
    assert "OMP_NUM_THREADS=2" in warning


def test_current_reads_this_machine() -> None:
    state = current()
    assert 1 <= state.cores <= (os.cpu_count() or 1) and state.load_1m >= 0
    assert current(torch_threads=3).torch_threads == 3


def test_verifier_warns_at_startup_before_loading() -> None:
    """64 threads per process on this machine's cores: the verifier says so first thing
    (here before it finds that its model does not exist)."""
    argv = ["verifier", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    r = subprocess.run(
        [sys.executable, "-m", "adaserve.cli", *argv, "--target", "/nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "64", "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 1
    warning = r.stderr.index("x 64 thread(s) each")
    assert warning < r.stderr.index("does not exist")
