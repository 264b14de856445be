"""GrpcDrafter: the Drafter interface over gRPC, for the synchronous engine.

Same trees as the in-process BeamDrafter. Lost draft state comes back as
DrafterStateLost(ids), exactly as in-process, so the engine re-sends those requests'
full history; bad input raises ValueError; an unreachable or failing service raises
ServiceUnavailable (a ConnectionError) and the engine decodes without speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from adaserve.drafter import DrafterStateLost, DrafterStats, DraftUpdate
from adaserve.rpc.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from adaserve.tree import CandidateTree
from services.common.client import call
from services.common.convert import speculate_request_to_pb, trees_from_pb
from services.common.options import channel

log = logging.getLogger("adaserve.engine")


class GrpcDrafter:
    def __init__(self, address: str, *, timeout_s: float = 0.5) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        # Server-side timing of the latest Speculate, for the engine's overhead metrics.
        self.last_timing: common_pb2.ServerTiming | None = None
        # What it drafts with (`describe`): "model", or "eagle" with its EagleSpec.
        self.kind = "model"
        self.spec = None

    def speculate(
        self, updates: Sequence[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        msg = speculate_request_to_pb(updates, depth, width, stop_prob)
        reply = call("drafter", self._stub.Speculate, msg, self.timeout_s)
        self.last_timing = reply.timing
        if reply.lost_ids:
            raise DrafterStateLost(list(reply.lost_ids))
        batch = trees_from_pb(reply.trees)
        if len(batch) != len(updates):
            raise ValueError(f"drafter returned {len(batch)} trees for {len(updates)} updates")
        return batch.trees()

    def release(self, ids: Sequence[str]) -> None:
        call(
            "drafter", self._stub.Release, drafter_pb2.ReleaseRequest(ids=list(ids)), self.timeout_s
        )

    # A drafter container starts beside its verifier (k8s/base/unit.yaml) and may still
    # be loading its model: an EAGLE head taken for a model drafter would leave the
    # unit decoding plainly for its whole life, so the verifier waits this long.
    DESCRIBE_WAIT_S = 60.0

    def describe(self, wait_s: float = DESCRIBE_WAIT_S) -> None:
        """Learns what the service drafts with (StatsResponse.kind): for an EAGLE head,
        `kind` "eagle" and `spec` (the target layers to send), which the engine reads
        when it is built. Waits up to `wait_s` for a service still loading; one not up
        by then is taken for a model drafter (logged): an EAGLE service would then
        refuse its updates and the engine decode plainly, never wrongly."""
        try:
            self.wait_ready(wait_s)
            reply = call("drafter", self._stub.Stats, drafter_pb2.StatsRequest(), self.timeout_s)
        except Exception as exc:  # any failure: the model drafter default
            log.warning(
                "drafter %s not described (%s): taken for a model drafter", self.address, exc
            )
            return
        if reply.kind == "eagle":
            from adaserve.model.eagle import EagleSpec

            dim = int(reply.feature_dim)
            layers = tuple(int(i) for i in reply.feature_layers)
            if not layers or dim % len(layers):
                raise ValueError(f"drafter {self.address}: EAGLE with {layers} and dim {dim}")
            self.kind = "eagle"
            self.spec = EagleSpec(layers, -1, dim // len(layers))

    def stats(self) -> DrafterStats:
        reply = call("drafter", self._stub.Stats, drafter_pb2.StatsRequest(), self.timeout_s)
        return DrafterStats(reply.num_sequences, reply.kv_usage)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Blocks until the channel connects (raises grpc.FutureTimeoutError)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcDrafter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
