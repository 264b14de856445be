"""A verifier unit's side of operating a fleet, over real gRPC in one process (tiny
random target): its load stream, draining, and liveness tied to the engine loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adaserve.engine import Engine
from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from services.common.convert import load_from_pb
from services.common.server import BackgroundServer
from services.verifier.server import LIVENESS, build_server
from tests._engine import make_engine
from tests.conftest import make_tiny_model


class WedgeableTarget:
    """The real target, whose forward can be made to hang (a wedged kernel, a lost
    collective) until released: fault injection for the liveness check."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self.wedged = threading.Event()
        self.released = threading.Event()

    def forward(self, *args: Any, **kw: Any) -> Any:
        if self.wedged.is_set():
            self.released.wait(30)
        return self._target.forward(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("fleet-target"), "llama", seed=0)


@pytest.fixture
def unit(target_dir) -> Iterator[tuple[Engine, WedgeableTarget, str]]:
    engine = make_engine(
        target_dir,
        fleet={"liveness_timeout_s": 0.5, "prefix_keys": 8},
        slo={"baseline_tpot_ms": 20.0},
    )
    wedge = WedgeableTarget(engine.target)
    engine.target = wedge  # pyright: ignore[reportAttributeAccessIssue]
    engine.start()
    server = BackgroundServer(lambda: build_server(engine, engine.settings, "127.0.0.1", 0))
    try:
        server.start()
        yield engine, wedge, server.address
    finally:
        wedge.released.set()
        server.stop()
        engine.stop()


def _request(rid: str, n: int = 8, keys: tuple[int, ...] = ()) -> vpb.GenerateRequest:
    req = vpb.GenerateRequest(
        request_id=rid,
        sampling=vpb.SamplingParams(max_tokens=n, ignore_eos=True),
        tpot_slo_ms=40.0,
        prefix_keys=keys,
    )
    req.token_ids.ids.extend([5, 6, 7, 8])
    return req


def _health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_load_stream_reports_occupancy_predictions_and_prefix_keys(unit) -> None:
    engine, _, address = unit
    with grpc.insecure_channel(address) as ch:
        stub = vgrpc.VerifierStub(ch)
        stream = stub.Load(vpb.LoadRequest(interval_ms=20), timeout=30)
        first = next(stream)
        load = load_from_pb(first)
        assert (load.running, load.waiting, load.draining) == (0, 0, False)
        assert load.max_running == engine.settings.engine.max_running
        sizes = [n for n, _ in load.tpot_curve]
        assert sizes[0] == 1 and sizes[-1] == load.max_running and sizes == sorted(sizes)
        assert all(ms > 0 for _, ms in load.tpot_curve) and load.prefill_ms_per_token > 0
        assert first.prefix_reset and list(first.prefix_keys) == [] and first.prefix_capacity == 8
        # A request's prefix keys come back on the stream, once.
        list(stub.Generate(_request("k1", keys=(11, 12, 13)), timeout=30))
        seen: list[int] = []
        t0 = time.monotonic()
        while len(seen) < 3 and time.monotonic() - t0 < 10:
            msg = next(stream)
            assert not msg.prefix_reset
            seen += msg.prefix_keys
        assert seen == [11, 12, 13]
        stream.cancel()


def test_a_draining_unit_refuses_new_requests_and_says_so_at_once(unit) -> None:
    engine, _, address = unit
    with grpc.insecure_channel(address) as ch:
        stub = vgrpc.VerifierStub(ch)
        stream = stub.Load(vpb.LoadRequest(interval_ms=60_000), timeout=30)
        assert not next(stream).draining
        engine.drain()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_request("late"), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in (err.value.details() or "")
        # The next report carries it (here at the next interval: the servicer's drain()
        # is what wakes the streams at once; test_fleet.py runs that through SIGTERM).
        stream.cancel()
        assert load_from_pb(next(stub.Load(vpb.LoadRequest(), timeout=30))).draining


def test_liveness_fails_while_the_engine_loop_is_wedged(unit) -> None:
    """A forward that never returns leaves gRPC answering: only the loop's heartbeat
    shows it. Liveness (and readiness) go NOT_SERVING past fleet.liveness_timeout_s, and
    come back, with the request finishing whole, once the loop moves again."""
    engine, wedge, address = unit
    assert _health(address, LIVENESS) == SERVING and _health(address, "") == SERVING
    wedge.wedged.set()
    with grpc.insecure_channel(address) as ch:
        stub = vgrpc.VerifierStub(ch)
        call = stub.Generate(_request("stuck", n=6), timeout=60)
        deadline = time.monotonic() + 10
        while _health(address, LIVENESS) == SERVING:
            assert time.monotonic() < deadline, "liveness never failed"
            time.sleep(0.1)
        assert engine.loop_age_s() > 0.5
        assert _health(address, "") == NOT_SERVING
        report = next(stub.Load(vpb.LoadRequest(), timeout=10))
        assert report.loop_age_ms > 500
        wedge.wedged.clear()
        wedge.released.set()
        tokens = [t for chunk in call for t in chunk.token_ids]
        assert len(tokens) == 6
    deadline = time.monotonic() + 10
    while _health(address, LIVENESS) != SERVING or _health(address, "") != SERVING:
        assert time.monotonic() < deadline, "liveness never came back"
        time.sleep(0.1)


def test_a_delta_for_a_reader_whose_loop_closed_is_kept_not_raised() -> None:
    """After a drain times out the server's loop closes while the engine thread still
    finishes its iteration: handing that iteration's deltas over must not fail it."""
    import asyncio

    from adaserve.request import TokenDelta
    from adaserve.slo import SLOVerdict
    from adaserve.stream import RequestStream

    stream = RequestStream("r", SLOVerdict(False, 1.0))

    async def start_reading() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(aiter(stream.aiter())), 0.01)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(start_reading())
    loop.close()
    delta = TokenDelta((1,), "a", None, 1, 1)
    stream.put(delta)  # the reader's loop is closed
    assert stream.get(timeout=0) == delta
