"""`adaserve scheduler --host H --port P [--config FILE]`: the stateless scheduler."""

from __future__ import annotations

import argparse
import sys

from adaserve.config import load_settings
from services.common import logs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--config", default=None, help="YAML settings file")
    logs.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # Imported here so `adaserve scheduler --help` stays instant.
    from services.common import tls
    from services.common.server import run_until_signal
    from services.scheduler.server import build_server

    logs.configure(args.log_level, args.log_format)
    from services.common.ports import PortInUse, check_free

    try:
        check_free(args.host, args.port, "--port N")
    except PortInUse as exc:
        print(f"adaserve scheduler: {exc}", file=sys.stderr)
        return 2
    try:  # a bad settings file is the user's to fix: no traceback
        settings = load_settings(args.config)
        tls.configure(settings.tls)
    except (OSError, ValueError) as exc:
        print(f"adaserve scheduler: {exc}", file=sys.stderr)
        return 2
    return run_until_signal(lambda: build_server(settings.scheduler, args.host, args.port))


if __name__ == "__main__":
    from adaserve.cli import main

    raise SystemExit(main(["scheduler", *sys.argv[1:]]))
