"""The verifier's engine, with the drafter and the scheduler reached over gRPC where
the settings give their addresses (`services.drafter`, `services.scheduler`).

`adaserve.engine_build` assembles the engine and keeps the core free of transport
code; this module hands it the gRPC clients. The verifier service, `adaserve generate`
and `adaserve up --all-in-one` build their engines here.
"""

from __future__ import annotations

from adaserve.config import SchedulerSettings, Settings
from adaserve.drafter import Drafter
from adaserve.engine import Engine
from adaserve.engine_build import build_drafter as _build_drafter
from adaserve.engine_build import build_engine as _build_engine
from adaserve.engine_build import build_scheduler as _build_scheduler
from adaserve.scheduler import Scheduler


def grpc_drafter(address: str, timeout_s: float) -> Drafter:
    from services.drafter.client import GrpcDrafter

    drafter = GrpcDrafter(address, timeout_s=timeout_s)
    drafter.describe()  # an EAGLE head needs the target's features from the start
    return drafter


def grpc_scheduler(address: str, settings: SchedulerSettings, timeout_s: float) -> Scheduler:
    from services.scheduler.client import GrpcScheduler

    return GrpcScheduler(address, settings, timeout_s=timeout_s)


def build_engine(settings: Settings) -> Engine:
    return _build_engine(settings, drafter_client=grpc_drafter, scheduler_client=grpc_scheduler)


def build_drafter(settings: Settings) -> Drafter | None:
    return _build_drafter(settings, grpc_drafter)


def build_scheduler(settings: Settings) -> Scheduler:
    return _build_scheduler(settings, grpc_scheduler)
