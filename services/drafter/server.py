"""The drafter servicer: convert, one domain call, convert back.

The drafter owns per-request draft KV, so calls must not interleave: they run one at
a time on a single worker thread. That keeps the event loop free for health checks
while the model computes (torch releases the GIL inside its kernels). Lost state is
an answer (SpeculateResponse.lost_ids), not an error, so the engine re-syncs those ids.
A call whose deadline passed while it waited for the worker is dropped unrun: its
caller has already fallen back, and running it would only delay the calls behind it.

On SIGTERM the drafter keeps serving while its verifier still calls it (in a pod both
containers get SIGTERM at once, and the verifier drains its streams): it stops once no
call came for DRAIN_IDLE_S, or after the drain timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from adaserve.drafter import Drafter, DrafterStateLost, DraftUpdate
from adaserve.model.kv_cache import KVCacheFull
from adaserve.rpc.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from adaserve.torch_thread import torch_thread
from adaserve.tree import CandidateTree
from services.common import faults
from services.common.convert import speculate_request_from_pb, trees_to_pb
from services.common.server import GrpcServer, Service

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
T = TypeVar("T")
# A draining verifier calls every iteration it drafts in; a CPU batch that plans plain
# decoding may go longer without, and then decodes plainly for the rest of its drain.
DRAIN_IDLE_S = 2.0


class DeadlinePassed(Exception):
    """The caller's deadline passed before the call reached the worker."""


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, drafter: Drafter, worker: ThreadPoolExecutor | None = None) -> None:
        self.drafter = drafter
        # The thread that loaded the model, where there is one (adaserve/torch_thread.py).
        self._worker = worker or torch_thread("drafter")
        self._fault_delay_s = faults.delay_s(faults.DRAFTER_DELAY_ENV)
        self.last_call = time.monotonic()  # of any RPC but Stats (the drain watches it)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def Speculate(
        self, request: drafter_pb2.SpeculateRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.SpeculateResponse:
        self.last_call = time.monotonic()
        t0 = time.perf_counter_ns()
        updates, depth, width, stop_prob = speculate_request_from_pb(request)
        t1 = time.perf_counter_ns()
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            trees = await self._run(self._speculate, updates, depth, width, stop_prob, deadline)
        except DrafterStateLost as lost:
            t2 = time.perf_counter_ns()
            return drafter_pb2.SpeculateResponse(
                lost_ids=list(lost.ids), timing=_timing(t0, t1, t2, t2)
            )
        t2 = time.perf_counter_ns()
        reply = drafter_pb2.SpeculateResponse(trees=trees_to_pb(trees))
        reply.timing.CopyFrom(_timing(t0, t1, t2, time.perf_counter_ns()))
        return reply

    def _speculate(
        self,
        updates: list[DraftUpdate],
        depth: int,
        width: int,
        stop_prob: float,
        deadline: float | None,
    ) -> list[CandidateTree]:
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlinePassed("the caller's deadline passed while the call was queued")
        if self._fault_delay_s:
            time.sleep(self._fault_delay_s)  # fault injection (services/common/faults.py)
        return self.drafter.speculate(updates, depth, width, stop_prob)

    async def Release(
        self, request: drafter_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.ReleaseResponse:
        self.last_call = time.monotonic()
        await self._run(self.drafter.release, list(request.ids))
        return drafter_pb2.ReleaseResponse()

    async def Stats(
        self, request: drafter_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.StatsResponse:
        stats = await self._run(self.drafter.stats)  # type: ignore[attr-defined]
        reply = drafter_pb2.StatsResponse(
            num_sequences=stats.num_sequences,
            kv_usage=stats.kv_usage,
            kind=str(getattr(self.drafter, "kind", "model")),
        )
        spec = getattr(self.drafter, "spec", None)  # an EAGLE head: what the verifier sends
        if spec is not None:
            reply.feature_layers.extend(spec.feature_layers)
            reply.feature_dim = spec.feature_dim
        return reply

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout_s: float, idle_s: float = DRAIN_IDLE_S) -> None:
        """Serve until no call came for `idle_s` (the verifier is done) or `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            quiet = time.monotonic() - self.last_call
            if quiet >= idle_s:
                return
            await asyncio.sleep(min(idle_s - quiet, max(deadline - time.monotonic(), 0.0)))


def _timing(t0: int, t1: int, t2: int, t3: int) -> common_pb2.ServerTiming:
    return common_pb2.ServerTiming(
        decode_us=(t1 - t0) // 1000, compute_us=(t2 - t1) // 1000, encode_us=(t3 - t2) // 1000
    )


def build_server(
    drafter: Drafter,
    host: str,
    port: int,
    *,
    grace_s: float = 5.0,
    worker: ThreadPoolExecutor | None = None,
    drain_timeout_s: float | None = None,
) -> GrpcServer:
    """`drain_timeout_s`: on SIGTERM, serve while the verifier still calls, up to this
    long (None: stop at once)."""
    servicer = DrafterServicer(drafter, worker)
    return GrpcServer(
        [
            Service(
                SERVICE_NAME,
                lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server),
            )
        ],
        host,
        port,
        grace_s=grace_s,
        error_codes={
            KVCacheFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
            DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
        },
        drain=None if drain_timeout_s is None else lambda: servicer.drain(drain_timeout_s),
    )
