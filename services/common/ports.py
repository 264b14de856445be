"""Ports checked before anything slow: a clash is reported in a second, naming the
port and the flag that sets it, not after the model has loaded."""

from __future__ import annotations

import errno
import socket


class PortInUse(OSError):
    """A port this process is about to listen on is taken (or cannot be bound)."""


def check_free(host: str, port: int, flag: str) -> None:
    """Raises PortInUse unless `port` can be bound on `host` right now (0: any port,
    nothing to check); the message says to choose another with `flag` ("--port N"). SO_REUSEADDR as the servers use it: a port left in TIME_WAIT
    by a process that just exited counts as free, one something listens on does not
    (gRPC's SO_REUSEPORT listeners included: this socket does not share)."""
    if port == 0:
        return
    bind_host = "" if host in ("0.0.0.0", "::", "") else host
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as exc:
            what = "is already in use" if exc.errno == errno.EADDRINUSE else f"({exc.strerror})"
            raise PortInUse(
                f"port {port} on {host or '0.0.0.0'} {what}: choose another with {flag}, "
                "or stop the process holding it"
            ) from exc
