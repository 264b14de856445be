"""`adaserve gateway`: the OpenAI-compatible REST API (and its gRPC twin) in front of
one or more verifier units."""

from __future__ import annotations

import argparse
import sys

from adaserve.config import load_settings
from services.common import logs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="HTTP and gRPC bind address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--grpc-port", type=int, default=50050, help="gRPC port of the same API; -1 disables it"
    )
    parser.add_argument(
        "--verifier",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a verifier unit (repeat for several); also settings services.verifiers",
    )
    parser.add_argument(
        "--verifier-dns",
        metavar="NAME:PORT",
        help="resolve NAME (a headless Service) to all its addresses every health interval",
    )
    parser.add_argument("--config", help="YAML settings file")
    logs.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from services.common import tls
    from services.common.server import new_event_loop

    logs.configure(args.log_level, args.log_format)
    try:
        settings = load_settings(args.config)
        tls.configure(settings.tls)  # to the units; the public fronts stay as they are
        verifiers = list(args.verifier) or list(settings.services.verifiers)
        dns = args.verifier_dns or settings.services.verifier_dns
        app = create_app(
            settings,
            verifiers,
            verifier_dns=dns,
            grpc_port=None if args.grpc_port < 0 else args.grpc_port,
            grpc_host=args.host,
        )
    except (FileNotFoundError, ValueError) as exc:  # pydantic's ValidationError included
        print(f"adaserve gateway: {exc}", file=sys.stderr)
        return 1
    # After the settings: a mistyped flag is reported as such even when a port is taken
    # (create_app binds nothing; its lifespan does).
    from services.common.ports import PortInUse, check_free

    try:
        check_free(args.host, args.port, "--port N")
        if args.grpc_port > 0:
            check_free(args.host, args.grpc_port, "--grpc-port N (-1 turns the gRPC front off)")
    except PortInUse as exc:
        print(f"adaserve gateway: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # keep our JSON handlers
        timeout_graceful_shutdown=5,
        # h11 explicitly: httptools (if installed) would ignore the header-size cap.
        http="h11",
        # A header this large is an attack or a bug; requests need a few hundred bytes.
        h11_max_incomplete_event_size=settings.gateway.max_header_bytes,
    )
    server = uvicorn.Server(config)
    loop = new_event_loop()
    try:
        loop.run_until_complete(server.serve())
    finally:
        loop.close()
    return 0 if server.started else 1
