"""One log format for every adaserve service: JSON lines on stderr by default.

Every service (gateway, verifier, drafter, scheduler) calls `configure` first thing, so
`adaserve up`'s log directory holds one format whatever the process. Fields passed with
`extra={...}` become top-level keys, so log pipelines can filter on request_id, unit or
status without parsing messages. `--log-format text` (or `ADASERVE_LOG_FORMAT=text`)
writes the same records as `time level logger: message key=value ...` for reading in a
terminal.

Progress bars (tqdm: a first run's GGUF conversion, downloads) are drawn only on a
terminal: in a log file they are a line of carriage returns per update.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

FORMATS = ("json", "text")
FORMAT_ENV = "ADASERVE_LOG_FORMAT"

# Attributes every LogRecord has; anything else came in through `extra`. uvicorn's
# `color_message` repeats `msg` with terminal escapes.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


def _timestamp(record: logging.LogRecord) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z"
    )


def _extra(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extra(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`2026-01-01T12:00:00.000Z info adaserve.engine: message key=value ...`"""

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={_value(v)}" for k, v in _extra(record).items())
        line = f"{_timestamp(record)} {record.levelname.lower()} {record.name}: "
        line += record.getMessage() + (f" {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _value(v: object) -> str:
    if not isinstance(v, str):  # compact JSON: a dict stays one unquoted token
        return json.dumps(v, default=str, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(v, ensure_ascii=False) if (" " in v or v == "") else v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, the same on every service."""
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=None,
        help=f"json lines or plain text (default: ${FORMAT_ENV}, else json)",
    )


def configure(level: str = "info", fmt: str | None = None) -> None:
    """Routes the root logger (and uvicorn's) to one line per record on stderr, and
    turns progress bars off unless stderr is a terminal."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or "json"
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # One line per request already comes from gateway.core; the access log repeats it.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.captureWarnings(True)  # warnings.warn lines in the same format
    if not sys.stderr.isatty():
        quiet_progress_bars()


def quiet_progress_bars() -> None:
    """No progress bars in this process. tqdm reads TQDM_* defaults when it is first
    imported (transformers' GGUF conversion creates its bar with no `disable`), and
    huggingface_hub has its own switch; a value the user set wins."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
