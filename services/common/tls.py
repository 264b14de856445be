"""Optional mutual TLS between adaserve services, from certificate files.

A service's `__main__` calls `configure(settings.tls)` once at start-up; from then on
every internal server (`GrpcServer`) listens with TLS and demands a client certificate
signed by the CA, and every internal channel (`options.channel`) presents the same
certificate and verifies the server's. Unconfigured (the default), both stay plaintext,
so tests and single-machine runs need no certificates. The gateway's public gRPC front
is not internal: it never demands client certificates.

Certificates are read when a server starts or a channel is made; rotating them means
restarting the process (a rolling restart in Kubernetes). `scripts/dev-ca.sh` makes a
development CA and per-service certificates.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from adaserve.config import TLSSettings

_process: TLSSettings | None = None


def configure(settings: TLSSettings | None) -> None:
    """Sets this process's TLS for internal servers and channels (None or unset files:
    plaintext). Reads the files once now, so a bad path fails at start-up, not at the
    first call."""
    global _process
    if settings is not None and settings.enabled:
        _load(settings)
        _process = settings
    else:
        _process = None


def current() -> TLSSettings | None:
    return _process


def server_credentials(settings: TLSSettings) -> grpc.ServerCredentials:
    ca, cert, key = _load(settings)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def channel_credentials(settings: TLSSettings) -> grpc.ChannelCredentials:
    ca, cert, key = _load(settings)
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def channel_options(settings: TLSSettings) -> list[tuple[str, str]]:
    if settings.server_name:
        return [("grpc.ssl_target_name_override", settings.server_name)]
    return []


def _load(settings: TLSSettings) -> tuple[bytes, bytes, bytes]:
    return (
        _read(settings.ca_file, "tls.ca_file"),
        _read(settings.cert_file, "tls.cert_file"),
        _read(settings.key_file, "tls.key_file"),
    )


def _read(path: str | None, setting: str) -> bytes:
    if not path:
        raise ValueError(f"{setting} is not set")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{setting}: no such file {p}")
    return p.read_bytes()
