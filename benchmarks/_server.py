"""`adaserve up` for benchmarks: start it on a port, wait until the gateway is ready,
stop it (the launcher stops its services in reverse order)."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from adaserve.commands.up import free_port

__all__ = ["free_port", "start_up", "stop_up"]


def start_up(
    args: list[str],
    port: int,
    log: Path,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`adaserve up --port PORT ARGS...` with its output in `log`, once /ready answers;
    `env` adds environment variables (settings such as ADASERVE_MODEL__CPU_KERNEL)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    # The services' own logs beside `log`, not in the working directory's ./logs.
    log_dir = ["--log-dir", str(log.with_suffix(""))] if "--log-dir" not in args else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaserve", "up", "--port", str(port), *log_dir, *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"adaserve up exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except (OSError, http.client.HTTPException):  # not up yet, or not ours (a port race)
            pass
        time.sleep(1.0)
    stop_up(proc)
    raise TimeoutError(f"adaserve up not ready after {timeout_s:.0f} s (log: {log})")


def stop_up(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
