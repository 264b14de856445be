"""Verifier units behind the gateway: least-outstanding-requests routing and health.

A unit is admitted once a gRPC health check says SERVING and its `Info` is known
(served model, context length, SLO classes); it is dropped on the first failed check or
when a call to it fails with UNAVAILABLE, and re-admitted by the next good check.
`--verifier-dns NAME:PORT` re-resolves a headless Service every interval, so units
appear and disappear with their pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from adaserve.slo import describe
from gateway.errors import APIError, model_not_found
from services.common.options import aio_channel

log = logging.getLogger(__name__)

VERIFIER_SERVICE = "adaserve.rpc.v1.Verifier"


@dataclass(eq=False)
class Unit:
    address: str
    channel: grpc.aio.Channel
    stub: vgrpc.VerifierStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    outstanding: int = 0
    info: vpb.InfoResponse | None = None
    from_dns: bool = False
    retired: bool = False  # gone from DNS: no new requests, closed once idle
    last_error: str = field(default="never checked")

    @classmethod
    def connect(cls, address: str, *, from_dns: bool = False) -> Unit:
        channel = aio_channel(address)
        return cls(
            address,
            channel,
            vgrpc.VerifierStub(channel),
            health_pb2_grpc.HealthStub(channel),
            from_dns=from_dns,
        )


class Router:
    """Must be started and used on one event loop (the gateway's)."""

    def __init__(
        self,
        addresses: list[str],
        *,
        dns: str | None = None,
        interval_s: float = 2.0,
        check_timeout_s: float = 1.0,
    ) -> None:
        for addr in addresses:
            parse_address(addr, "--verifier")
        self.static = list(dict.fromkeys(addresses))
        self.dns = parse_address(dns, "--verifier-dns") if dns else None
        self.interval_s = interval_s
        self.check_timeout_s = check_timeout_s
        self.units: dict[str, Unit] = {}
        self._rr = itertools.count()  # breaks ties between equally loaded units
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        for addr in self.static:
            self.units[addr] = Unit.connect(addr)
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="verifier-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for unit in self.units.values():
            await unit.channel.close()
        self.units.clear()

    # -- routing -----------------------------------------------------------------------

    def healthy(self) -> list[Unit]:
        return [u for u in self.units.values() if u.healthy and not u.retired]

    def models(self) -> list[str]:
        names = {u.info.served_model_name for u in self.healthy() if u.info}
        return sorted(names)

    def slo_classes(self) -> set[str]:
        return {name for u in self.healthy() if u.info for name in u.info.slo_classes}

    def pick(self, model: str | None, exclude: frozenset[str] = frozenset()) -> Unit:
        """The least loaded healthy unit serving `model` (None: any), skipping units
        that already failed this request."""
        units = self.healthy()
        if model is not None and units:
            units = [u for u in units if u.info and u.info.served_model_name == model]
            if not units:
                raise model_not_found(model)
        units = [u for u in units if u.address not in exclude]
        if not units:
            raise APIError(
                503,
                "no healthy serving unit is available; retry shortly",
                code="no_healthy_unit",
                retry_after_s=self.interval_s,
            )
        least = min(u.outstanding for u in units)
        tied = [u for u in units if u.outstanding == least]
        return tied[next(self._rr) % len(tied)]

    @contextlib.contextmanager
    def lease(self, unit: Unit) -> Iterator[Unit]:
        unit.outstanding += 1
        try:
            yield unit
        finally:
            unit.outstanding -= 1

    def mark_failed(self, unit: Unit, reason: str) -> None:
        if unit.healthy:
            log.warning("verifier unit dropped", extra={"unit": unit.address, "reason": reason})
        unit.healthy = False
        unit.last_error = reason

    # -- health ------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # a bad round must not end health checking for good
                log.exception("health round failed")

    async def refresh(self) -> None:
        if self.dns is not None:
            await self._resolve()
        units = list(self.units.values())
        await asyncio.gather(*(self._check(u) for u in units))
        for unit in units:
            if unit.retired and unit.outstanding == 0:
                self.units.pop(unit.address, None)
                await unit.channel.close()

    async def _resolve(self) -> None:
        assert self.dns is not None
        host, port = self.dns
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            # Keep the units we have: a DNS hiccup must not empty the pool.
            log.warning("verifier DNS lookup failed", extra={"name": host, "error": str(exc)})
            return
        found = {_join(info[4][0], port) for info in infos}
        for addr in found - self.units.keys():
            self.units[addr] = Unit.connect(addr, from_dns=True)
            log.info("verifier unit discovered", extra={"unit": addr})
        for addr, unit in self.units.items():
            unit.retired = unit.from_dns and addr not in found

    async def _check(self, unit: Unit) -> None:
        try:
            reply = await unit.health.Check(
                health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                timeout=self.check_timeout_s,
            )
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                raise RuntimeError("health status NOT_SERVING")
            # Every round: the unit's SLO floor follows its measured iteration times
            # (GET /v1/slo shows it).
            unit.info = await unit.stub.Info(vpb.InfoRequest(), timeout=self.check_timeout_s)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            self.mark_failed(unit, reason)
            return
        if not unit.healthy:
            info = unit.info
            classes = dict(info.slo_classes)
            log.info(
                f"verifier unit healthy: {info.served_model_name} at {unit.address}; "
                + describe(
                    info.baseline_tpot_ms, classes, info.default_slo_class, info.slo_floor_ms
                ),
                extra={
                    "unit": unit.address,
                    "model": info.served_model_name,
                    "baseline_tpot_ms": round(info.baseline_tpot_ms, 2),
                    "slo_classes_ms": {k: round(v, 2) for k, v in classes.items()},
                    "default_slo_class": info.default_slo_class,
                    "slo_floor_ms": round(info.slo_floor_ms, 2),
                },
            )
        unit.healthy = True
        unit.last_error = ""


def parse_address(spec: str, what: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 hosts in brackets); ValueError naming the option otherwise."""
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT, got {spec!r}")
    return host.strip("[]"), int(port)


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
