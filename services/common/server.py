"""One way to run a grpc.aio server: uvloop, health checking, reflection, domain-error
mapping, shared options, and a graceful stop on SIGTERM/SIGINT: health goes NOT_SERVING
first so load balancers drain, then the service's own `drain` runs (a verifier lets its
streams finish), then in-flight calls get `grace_s`. A second signal cuts the drain
short."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import tls
from services.common.errors import DomainErrorInterceptor, ErrorCodes
from services.common.options import SERVER_OPTIONS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Service:
    name: str  # full proto name, e.g. "adaserve.rpc.v1.Scheduler"
    register: Callable[[grpc.aio.Server], None]  # adds the servicer to a server


class GrpcServer:
    """Must be created, started and stopped on the event loop that serves it."""

    def __init__(
        self,
        services: Sequence[Service],
        host: str,
        port: int,
        *,
        grace_s: float = 5.0,
        error_codes: ErrorCodes | None = None,
        max_receive_bytes: int | None = None,
        public: bool = False,
        on_start: Callable[[GrpcServer], Awaitable[None]] | None = None,
        drain: Callable[[], Awaitable[None]] | None = None,
        extra_health: Sequence[str] = (),
    ) -> None:
        """`error_codes` maps domain exceptions to status codes beyond the default
        ValueError -> INVALID_ARGUMENT (see services/common/errors.py);
        `max_receive_bytes` lowers the shared message-size cap and `public` keeps the
        internal mutual TLS off (both for the gateway's client-facing front).
        `on_start` runs once the server serves (background tasks); `drain` runs on the
        first SIGTERM/SIGINT, after health went NOT_SERVING and before the stop;
        `extra_health` names health entries of the service's own (a liveness check)
        that start SERVING and that the stop leaves alone."""
        self.services = list(services)
        self.tls = None if public else tls.current()
        self.address = f"{host}:{port}"
        self.grace_s = grace_s
        self.port = port
        self._health = health.aio.HealthServicer()
        self._on_start = on_start
        self._drain = drain
        self._extra_health = list(extra_health)
        self._tasks: list[asyncio.Task] = []  # background work, cancelled by stop()
        options = list(SERVER_OPTIONS)
        if max_receive_bytes is not None:
            key = "grpc.max_receive_message_length"
            options = [o for o in options if o[0] != key] + [(key, max_receive_bytes)]
        self._server = grpc.aio.server(
            interceptors=[DomainErrorInterceptor(error_codes)], options=options
        )

    async def start(self) -> int:
        """Binds and starts; returns the bound port (useful with port 0)."""
        for svc in self.services:
            svc.register(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [svc.name for svc in self.services]
        reflection.enable_server_reflection(
            [
                *names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self._server,
        )
        try:
            if self.tls is None:
                self.port = self._server.add_insecure_port(self.address)
            else:
                creds = tls.server_credentials(self.tls)
                self.port = self._server.add_secure_port(self.address, creds)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {self.address}: {exc}") from exc
        await self._server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        for name in self._extra_health:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self._on_start is not None:
            await self._on_start(self)
        log.info(
            "serving %s on port %d (%s)",
            ", ".join(names),
            self.port,
            "mutual TLS" if self.tls is not None else "plaintext",
        )
        return self.port

    def spawn(self, coro: Coroutine[None, None, None], name: str) -> None:
        """Runs `coro` beside the server until it stops."""
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def stop(self, grace_s: float | None = None) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self._server.stop(self.grace_s if grace_s is None else grace_s)

    async def set_health(self, status: int, names: Sequence[str] | None = None) -> None:
        """Health of `names` (default: the server as a whole and every service)."""
        if names is None:
            await self._set_health(status)
            return
        for name in names:
            await self._health.set(name, status)

    async def serve_until_signal(self) -> None:
        signals = asyncio.Queue[int]()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        waiter = asyncio.ensure_future(self._server.wait_for_termination())
        first = asyncio.ensure_future(signals.get())
        await asyncio.wait({waiter, first}, return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            if self._drain is not None:
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                await self._drain_or_signal(signals)
            log.info("stopping: in-flight calls get up to %.1f s", self.grace_s)
            await self.stop()
        first.cancel()
        await waiter

    async def _drain_or_signal(self, signals: asyncio.Queue[int]) -> None:
        """The service's drain, cut short by a second signal (an impatient operator)."""
        assert self._drain is not None
        drain = asyncio.ensure_future(self._drain())
        second = asyncio.ensure_future(signals.get())
        await asyncio.wait({drain, second}, return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            log.warning("second signal: stopping without waiting for the drain")
            drain.cancel()
        second.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drain

    async def _set_health(self, status: int) -> None:
        for name in ["", *(svc.name for svc in self.services)]:
            await self._health.set(name, status)


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop has no Windows build; the default loop still works
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_until_signal(make_server: Callable[[], GrpcServer]) -> int:
    """Blocking entry point of a service's `__main__`: serve on uvloop until SIGTERM.
    Asked for port 0, it prints `listening on HOST:PORT` on stdout once bound: the one
    line a parent process reads to learn the port (logs go to stderr)."""

    async def main() -> None:
        server = make_server()
        any_port = server.port == 0
        await server.start()
        if any_port:
            print(f"listening on {server.address.rsplit(':', 1)[0]}:{server.port}", flush=True)
        await server.serve_until_signal()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())
    return 0


class BackgroundServer:
    """A GrpcServer on its own uvloop thread, for in-process deployments, tests and
    benchmarks whose callers are synchronous."""

    def __init__(self, make_server: Callable[[], GrpcServer]) -> None:
        self._make_server = make_server
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._server: GrpcServer | None = None
        self.port = 0

    def start(self) -> int:
        self._thread.start()
        self.port = self._call(self._start())
        return self.port

    def stop(self, grace_s: float = 0.5) -> None:
        if self._server is not None:
            self._call(self._server.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        with contextlib.suppress(RuntimeError):
            self.loop.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _start(self) -> int:
        self._server = self._make_server()
        return await self._server.start()

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)
