#!/usr/bin/env python3
"""Container HEALTHCHECK for every adaserve service in one image.

The image runs whichever service its command names, so the check reads that command
(PID 1's command line by default) to learn the service and its port, then asks it:
HTTP `GET /health` for the gateway (and `adaserve up`), the standard gRPC health
service for scheduler, drafter and verifier. Exit 0 when healthy, 1 otherwise, as
Docker expects. Kubernetes ignores HEALTHCHECK and uses the manifests' probes.

    adaserve-healthcheck                        # inspect PID 1
    adaserve-healthcheck --cmdline "adaserve scheduler --port 50051"
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORTS = {
    "gateway": 8000,
    "up": 8000,
    "scheduler": 50051,
    "drafter": 50052,
    "verifier": 50053,
}
HTTP_SERVICES = {"gateway", "up"}
# A server bound to every interface is reached on loopback from inside the container.
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


@dataclass(frozen=True)
class Target:
    service: str
    host: str
    port: int


def parse_command(argv: list[str]) -> Target:
    """Find `adaserve <service> ... [--host H] [--port P]` in a process's argv."""
    service_at = next((i for i, a in enumerate(argv) if a in DEFAULT_PORTS), None)
    if service_at is None:
        raise ValueError(f"no adaserve service in command line: {shlex.join(argv)!r}")
    service = argv[service_at]
    flags = _flags(argv[service_at + 1 :])
    host = flags.get("--host", "127.0.0.1")
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    port_text = flags.get("--port", str(DEFAULT_PORTS[service]))
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad --port {port_text!r} in command line")
    return Target(service, host, int(port_text))


def _flags(args: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            out[key] = value
        elif arg.startswith("--") and i + 1 < len(args):
            out[arg] = args[i + 1]
    return out


def check(target: Target, timeout_s: float) -> tuple[bool, str]:
    if target.service in HTTP_SERVICES:
        return _check_http(target, timeout_s)
    return _check_grpc(target, timeout_s)


def _check_http(target: Target, timeout_s: float) -> tuple[bool, str]:
    url = f"http://{_netloc(target)}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200, f"{url} -> {resp.status}"
    except OSError as exc:  # URLError, HTTPError and timeouts are all OSErrors
        return False, f"{url} -> {exc}"


def _check_grpc(target: Target, timeout_s: float) -> tuple[bool, str]:
    # Imported here so the HTTP path never pays for grpc.
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = _netloc(target)
    with _channel(grpc, address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"grpc {address} -> {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"grpc {address} -> {status}"


def _channel(grpc, address: str):  # type: ignore[no-untyped-def]
    """Plaintext, or the services' mutual TLS when the container's environment sets it
    (ADASERVE_TLS__CA_FILE, __CERT_FILE, __KEY_FILE, optional __SERVER_NAME; see
    docs/SECURITY.md): a server that demands client certificates refuses plaintext."""
    env = os.environ
    if not env.get("ADASERVE_TLS__CA_FILE"):
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(env["ADASERVE_TLS__CA_FILE"]).read_bytes(),
        private_key=Path(env["ADASERVE_TLS__KEY_FILE"]).read_bytes(),
        certificate_chain=Path(env["ADASERVE_TLS__CERT_FILE"]).read_bytes(),
    )
    name = env.get("ADASERVE_TLS__SERVER_NAME")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, creds, options=options)


def _netloc(target: Target) -> str:
    host = f"[{target.host}]" if ":" in target.host else target.host
    return f"{host}:{target.port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="adaserve-healthcheck", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--cmdline", help="the service's command line (default: PID 1's)")
    parser.add_argument("--pid", type=int, default=1, help="process whose command to inspect")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per check")
    args = parser.parse_args(argv)
    try:
        if args.cmdline is not None:
            command = shlex.split(args.cmdline)
        else:
            raw = Path(f"/proc/{args.pid}/cmdline").read_bytes()
            command = [part.decode() for part in raw.split(b"\0") if part]
        target = parse_command(command)
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    ok, detail = check(target, args.timeout)
    print(("healthy: " if ok else "unhealthy: ") + detail, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
