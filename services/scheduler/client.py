"""GrpcScheduler: the Scheduler interface over gRPC, for the synchronous engine.

Same answers as LocalScheduler for the same settings. Bad input raises
SelectionError (as in-process); an unreachable or failing service raises
ServiceUnavailable (a ConnectionError) so the engine can fall back to in-process
selection.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from adaserve.config import SchedulerSettings
from adaserve.rpc.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from adaserve.selection import RequestProgress, Selection, SelectionError, SelectionParams
from adaserve.tree import CandidateTree, TreeBatch
from services.common.client import call
from services.common.convert import select_request_to_pb, selection_from_pb
from services.common.options import channel


class GrpcScheduler:
    def __init__(
        self,
        address: str,
        settings: SchedulerSettings | None = None,
        *,
        timeout_s: float = 0.2,
    ) -> None:
        """With `settings`, Plan calls carry its budget so both ends plan for the same B
        (policy and order always travel with each Select); without, the server's
        configured budget applies."""
        self.address = address
        self.budget = settings.budget if settings is not None else None
        self.timeout_s = timeout_s
        self._channel = channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        # Server-side timing of the latest Select, for the engine's overhead metrics.
        self.last_timing: common_pb2.ServerTiming | None = None

    def plan(self, n: int) -> tuple[int, int]:
        reply = call(
            "scheduler",
            self._stub.Plan,
            scheduler_pb2.PlanRequest(n=n, budget=self.budget),
            self.timeout_s,
        )
        return reply.depth, reply.width

    def select(
        self,
        requests: Sequence[RequestProgress],
        trees: Sequence[CandidateTree] | TreeBatch,
        params: SelectionParams,
    ) -> Selection:
        try:
            msg = select_request_to_pb(requests, trees, params)
            reply = call("scheduler", self._stub.Select, msg, self.timeout_s)
        except ValueError as exc:
            raise SelectionError(str(exc)) from None
        self.last_timing = reply.timing
        return selection_from_pb(reply.selection)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Blocks until the channel connects (raises grpc.FutureTimeoutError)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
