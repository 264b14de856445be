"""`adaserve up` as a subprocess: launch it and wait for a line of its output."""

from __future__ import annotations

import re
import time
from pathlib import Path

from tests._serving import TEST_CONFIG, Proc, free_port


def launch_up(tmp: Path, *args: str, metrics_port: int | None = None) -> tuple[Proc, int]:
    cfg = tmp / "cfg.yaml"
    cfg.write_text(TEST_CONFIG)
    port = free_port()
    # Not the fixed default: other test runs may hold it.
    metrics = free_port() if metrics_port is None else metrics_port
    opts = f"up --port {port} --config {cfg} --log-dir {tmp / 'logs'} --startup-timeout 240"
    opts += f" --metrics-port {metrics}"
    proc = Proc([*opts.split(), *args], tmp / "up.log")
    return proc, port


def wait_for_line(proc: Proc, pattern: str, timeout: float = 240.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.log_path.read_text(errors="replace")
        if re.search(pattern, text):
            return text
        proc.check_alive()
        time.sleep(0.25)
    raise TimeoutError(f"{pattern!r} not seen:\n{proc.log()}")
