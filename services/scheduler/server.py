"""The scheduler servicer: convert, one domain call, convert back.

Stateless: it holds only its settings (defaults for UNSPECIFIED policy/order and for
a Plan without a budget), so any replica answers any call. Selection runs on the
event loop itself: it is a few hundred microseconds of numpy, less than a hop to an
executor thread would cost. Bad input raises ValueError, which the server's
interceptor turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import time

import grpc

from adaserve.adaptive import plan_depth_width
from adaserve.config import SchedulerSettings
from adaserve.rpc.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from adaserve.selection import select
from services.common.convert import select_request_from_pb, selection_to_pb
from services.common.server import GrpcServer, Service

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings

    async def Select(
        self, request: scheduler_pb2.SelectRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SelectResponse:
        t0 = time.perf_counter_ns()
        requests, trees, params = select_request_from_pb(
            request, self.settings.policy, self.settings.order
        )
        t1 = time.perf_counter_ns()
        selection = select(requests, trees, params)
        t2 = time.perf_counter_ns()
        reply = scheduler_pb2.SelectResponse(selection=selection_to_pb(selection))
        t3 = time.perf_counter_ns()
        reply.timing.CopyFrom(
            common_pb2.ServerTiming(
                decode_us=(t1 - t0) // 1000,
                compute_us=(t2 - t1) // 1000,
                encode_us=(t3 - t2) // 1000,
            )
        )
        return reply

    async def Plan(
        self, request: scheduler_pb2.PlanRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.PlanResponse:
        budget = request.budget if request.HasField("budget") else self.settings.budget
        depth, width = plan_depth_width(request.n, budget, self.settings.adaptive)
        return scheduler_pb2.PlanResponse(depth=depth, width=width)


def build_server(
    settings: SchedulerSettings, host: str, port: int, *, grace_s: float = 5.0
) -> GrpcServer:
    servicer = SchedulerServicer(settings)
    return GrpcServer(
        [
            Service(
                SERVICE_NAME,
                lambda server: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server),
            )
        ],
        host,
        port,
        grace_s=grace_s,
    )
