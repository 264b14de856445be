"""Channel options used by every adaserve server and client.

Both ends read the same numbers: a client that pings more often than its server
permits gets GOAWAY ("too_many_pings"), and a message-size limit set on one end only
fails the largest batches in production but never in small tests.
"""

from __future__ import annotations

import grpc

from services.common import tls

# A SpeculateResponse for 256 requests of 1 + 8*16 nodes is ~400 KB and a verifier
# prompt a few MB; 64 MiB leaves room without letting one call eat the host.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CLIENT_KEEPALIVE_MS = 20_000  # ping an idle connection this often ...
KEEPALIVE_TIMEOUT_MS = 10_000  # ... and drop it when a ping goes unanswered this long
# The server must tolerate the client's ping rate, so it is derived from it.
SERVER_MIN_PING_INTERVAL_MS = CLIENT_KEEPALIVE_MS // 2

_COMMON: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    *_COMMON,
    ("grpc.keepalive_time_ms", 2 * CLIENT_KEEPALIVE_MS),
    ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 2),
    # Two servers must never share a port silently (Linux allows it with SO_REUSEPORT).
    ("grpc.so_reuseport", 0),
]

CLIENT_OPTIONS: list[tuple[str, int]] = [
    *_COMMON,
    ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Fail fast and reconnect quickly: the engine falls back while a service is down.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 1),
]


def insecure_channel(address: str) -> grpc.Channel:
    """A blocking plaintext channel to `host:port` (the engine is synchronous)."""
    return grpc.insecure_channel(address, options=CLIENT_OPTIONS)


def aio_insecure_channel(address: str) -> grpc.aio.Channel:
    """An asyncio plaintext channel to `host:port`, same options."""
    return grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)


def channel(address: str) -> grpc.Channel:
    """A blocking channel to another adaserve service: mutual TLS when this process
    configured it (services/common/tls.py), plaintext otherwise."""
    settings = tls.current()
    if settings is None:
        return insecure_channel(address)
    options = CLIENT_OPTIONS + tls.channel_options(settings)
    return grpc.secure_channel(address, tls.channel_credentials(settings), options=options)


def aio_channel(address: str) -> grpc.aio.Channel:
    """`channel` for asyncio callers."""
    settings = tls.current()
    if settings is None:
        return aio_insecure_channel(address)
    options = CLIENT_OPTIONS + tls.channel_options(settings)
    return grpc.aio.secure_channel(address, tls.channel_credentials(settings), options=options)
