"""Verifier units behind the gateway: SLO-aware routing on their load reports, health.

A unit is admitted once a gRPC health check says SERVING and its `Info` is known
(served model, context length, SLO classes); it is dropped on the first failed check or
when a call to it fails with UNAVAILABLE, and re-admitted by the next good check.
`--verifier-dns NAME:PORT` re-resolves a headless Service every interval, so units
appear and disappear with their pods.

Each admitted unit streams its load (`Verifier.Load`: occupancy, predicted TPOT by batch
size, tightest SLO, prefill queue, the prefix keys it was sent, draining) to the router,
which routes every request with `adaserve.routing.route` (setting `fleet.routing`): the
unit where its SLO is most likely met, preferring the one that holds its prefix, and
least outstanding requests where reports are stale. A unit that reports draining, or
whose stream fails with UNAVAILABLE, gets nothing more at once, without waiting for the
next health round.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adaserve import routing
from adaserve.config import FleetSettings
from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from adaserve.slo import describe
from gateway.errors import APIError, model_not_found
from services.common.convert import load_from_pb
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
    # The unit's last load report (Verifier.Load) and when it arrived (monotonic s).
    load: routing.UnitLoad | None = None
    load_at: float = 0.0
    sent_since_report: int = 0  # requests routed here after that report was made
    prefixes: routing.PrefixMirror | None = None  # the unit's prefix keys, replayed
    reports: bool = True  # False: the unit has no Load stream (an older version)
    report_task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def draining(self) -> bool:
        return self.load is not None and self.load.draining

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
        fleet: FleetSettings | None = None,
        on_route: Callable[[str], None] | None = None,
    ) -> None:
        """`fleet`: routing policy and load-report timing (defaults: FleetSettings());
        `on_route(reason)` is told the reason of every routing decision (metrics)."""
        for addr in addresses:
            parse_address(addr, "--verifier")
        self.fleet = fleet or FleetSettings()
        self.params = routing.RoutingParams(
            self.fleet.routing, self.fleet.report_stale_ms / 1000.0, self.fleet.kv_limit
        )
        self.on_route = on_route
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
            await self._stop_reports(unit)
            await unit.channel.close()
        self.units.clear()

    # -- routing -----------------------------------------------------------------------

    def healthy(self) -> list[Unit]:
        return [u for u in self.units.values() if u.healthy and not u.retired and not u.draining]

    def models(self) -> list[str]:
        names = {u.info.served_model_name for u in self.healthy() if u.info}
        return sorted(names)

    def slo_classes(self) -> set[str]:
        return {name for u in self.healthy() if u.info for name in u.info.slo_classes}

    def fleet_slo(self, model: str | None, slo_class: str | None) -> tuple[str, float] | None:
        """(class, TPOT SLO ms) of `slo_class` (None: the units' default class) for the
        whole fleet: the median of what the healthy units serving `model` (None: any)
        resolve it to. Each unit resolves a class against the baseline it measured at
        startup (`slo.baseline_tpot_ms: auto`), so units on the same hardware differ by
        their measurement noise: one value for all keeps a class's promise the same
        whichever unit serves it. None where no unit knows the class."""
        infos = [
            u.info
            for u in self.healthy()
            if u.info and (model is None or u.info.served_model_name == model)
        ]
        if not infos:
            return None
        if slo_class is None:  # the most common default (all units share one config)
            defaults = [i.default_slo_class for i in infos]
            slo_class = max(sorted(set(defaults)), key=defaults.count)
        values = [i.slo_classes[slo_class] for i in infos if slo_class in i.slo_classes]
        return (slo_class, statistics.median(values)) if values else None

    def pick(
        self,
        model: str | None,
        exclude: frozenset[str] = frozenset(),
        request: routing.RouteRequest | None = None,
        tpot_slo_ms: float | None = None,
        slo_class: str | None = None,
    ) -> Unit:
        """The healthy unit serving `model` (None: any) that routing picks for the
        request (adaserve/routing.py), skipping units that already failed it. The
        request's TPOT SLO: `tpot_slo_ms`, else its class (None: the default) as each
        unit resolves it."""
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
        request = request or routing.RouteRequest()
        now = time.monotonic()
        cands = [self._candidate(u, request, now, tpot_slo_ms, slo_class) for u in units]
        decision = routing.route(request, cands, self.params)
        tied = [units[i] for i in decision.choices]
        unit = tied[next(self._rr) % len(tied)]
        unit.sent_since_report += 1
        if self.on_route is not None:
            self.on_route(decision.reason)
        return unit

    @staticmethod
    def _candidate(
        unit: Unit,
        request: routing.RouteRequest,
        now: float,
        tpot_slo_ms: float | None,
        slo_class: str | None,
    ) -> routing.Candidate:
        info = unit.info
        tpot, ttft = tpot_slo_ms, None
        if info is not None:
            name = slo_class or info.default_slo_class
            if tpot is None:
                tpot = info.slo_classes.get(name)
            if request.ttft_slo_ms is None:
                ttft = info.slo_class_ttft_ms.get(name)
        return routing.Candidate(
            outstanding=unit.outstanding,
            load=unit.load,
            load_age_s=now - unit.load_at if unit.load is not None else float("inf"),
            sent_since_report=unit.sent_since_report,
            tpot_slo_ms=tpot,
            prefix_match=(
                routing.match_depth(request.prefix_keys, unit.prefixes) if unit.prefixes else 0
            ),
            ttft_slo_ms=ttft,
        )

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
                await self._stop_reports(unit)
                await unit.channel.close()
            elif unit.healthy and unit.reports:
                self._start_reports(unit)

    # -- load reports ------------------------------------------------------------------

    def _start_reports(self, unit: Unit) -> None:
        if unit.report_task is None or unit.report_task.done():
            unit.report_task = asyncio.create_task(
                self._follow_reports(unit), name=f"load-{unit.address}"
            )

    async def _stop_reports(self, unit: Unit) -> None:
        task, unit.report_task = unit.report_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow_reports(self, unit: Unit) -> None:
        """Keeps `unit.load` current from its Load stream until the stream ends; the
        next health round opens a new one if the unit is still healthy."""
        call = unit.stub.Load(vpb.LoadRequest(interval_ms=self.fleet.report_interval_ms))
        try:
            async for msg in call:
                self._apply_report(unit, msg)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                # An older unit: like a stale one, it gets requests only while no unit
                # reports fresh (upgrade every unit for SLO-aware routing).
                unit.reports = False
                log.warning("verifier unit sends no load reports", extra={"unit": unit.address})
            elif err.code() == grpc.StatusCode.UNAVAILABLE:
                self.mark_failed(unit, f"Load: {err.details()}")
            unit.load = None
        except ValueError as exc:  # a report routing cannot use
            log.warning("bad load report", extra={"unit": unit.address, "error": str(exc)})
            unit.load = None
        finally:
            call.cancel()

    def _apply_report(self, unit: Unit, msg: vpb.LoadReport) -> None:
        was_draining = unit.draining
        unit.load = load_from_pb(msg)
        unit.load_at = time.monotonic()
        unit.sent_since_report = 0
        capacity = max(msg.prefix_capacity, 1)
        if unit.prefixes is None or unit.prefixes.capacity != capacity:
            unit.prefixes = routing.PrefixMirror(capacity)
        if msg.prefix_reset:
            unit.prefixes.clear()
        unit.prefixes.touch(msg.prefix_keys)
        if unit.draining and not was_draining:
            log.info("verifier unit draining: no new requests", extra={"unit": unit.address})

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
