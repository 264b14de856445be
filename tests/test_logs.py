"""Every service logs through services/common/logs.py: one line per record, JSON or
text, `extra` fields as keys, and progress bars only on a terminal."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from services.common import logs
from tests._serving import REPO


def _record(**extra: object) -> logging.LogRecord:
    record = logging.makeLogRecord(
        {"name": "adaserve.test", "levelname": "INFO", "msg": "unit %s", "args": ("up",)}
    )
    record.__dict__.update(extra)
    return record


def test_json_lines_carry_extra_fields_as_keys() -> None:
    line = logs.JsonFormatter().format(_record(unit="127.0.0.1:1", tpot_ms=12.5))
    out = json.loads(line)
    assert out["msg"] == "unit up" and out["level"] == "info" and out["logger"] == "adaserve.test"
    assert out["unit"] == "127.0.0.1:1" and out["tpot_ms"] == 12.5
    # uvicorn's copy of the message with terminal colours is noise in a log file.
    assert "color_message" not in json.loads(
        logs.JsonFormatter().format(_record(color_message="x"))
    )


def test_text_lines_are_time_level_logger_message_and_key_values() -> None:
    line = logs.TextFormatter().format(_record(unit="a b", n=3, ok=True, ms={"x": 1.5}))
    stamp, level, logger, rest = line.split(" ", 3)
    assert stamp.endswith("Z") and "T" in stamp
    assert (level, logger) == ("info", "adaserve.test:")
    assert rest == 'unit up unit="a b" n=3 ok=true ms={"x":1.5}'


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="json, text"):
        logs.configure("info", "xml")


def _tqdm_disabled(env_extra: str = "") -> str:
    code = (
        f"import os; {env_extra}\n"
        "from services.common import logs; logs.configure('info')\n"
        "from tqdm import tqdm; print(tqdm(range(2)).disable)"
    )
    # stderr is a pipe here, as in `adaserve up`'s log files.
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_progress_bars_are_off_when_stderr_is_not_a_terminal() -> None:
    assert _tqdm_disabled() == "True"
    # What the user set wins.
    assert _tqdm_disabled("os.environ['TQDM_DISABLE'] = ''") == "False"
