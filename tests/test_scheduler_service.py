"""The scheduler service through a real grpc.aio server on loopback and the real
client: same answers as in-process selection, INVALID_ARGUMENT naming the field for
every kind of malformed input, health checking, reflection, and the `adaserve
scheduler` command line with a graceful SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from adaserve.config import SchedulerSettings
from adaserve.rpc.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from adaserve.scheduler import LocalScheduler
from adaserve.selection import (
    ProgressBatch,
    RequestProgress,
    SelectionError,
    SelectionParams,
    select,
)
from adaserve.tree import CandidateTree
from services.common.client import ServiceUnavailable
from services.common.convert import (
    F32,
    F64,
    I32,
    I64,
    packed,
    progress_from_pb,
    progress_to_pb,
    select_request_to_pb,
    selection_from_pb,
)
from services.common.options import insecure_channel
from services.common.server import BackgroundServer
from services.scheduler.client import GrpcScheduler
from services.scheduler.server import SERVICE_NAME, build_server
from tests._selection import assert_same_selection, random_batch


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(lambda: build_server(SchedulerSettings(), "127.0.0.1", 0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[GrpcScheduler]:
    with GrpcScheduler(server.address, timeout_s=5.0) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server: BackgroundServer) -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    with insecure_channel(server.address) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


@pytest.mark.parametrize("policy", ["adaserve", "paper", "equal", "global", "optimal"])
@pytest.mark.parametrize("seed", range(6))
def test_grpc_matches_in_process(client: GrpcScheduler, policy: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    requests, trees = random_batch(rng, n)
    params = SelectionParams(
        budget=int(rng.integers(n, 6 * n + 2)),
        depth=int(rng.integers(0, 9)),
        t_spec_ms=float(rng.uniform(5, 60)),
        policy=policy,
        n_max=None if seed % 2 else int(rng.integers(1, 12)),
        order="ascending_a" if seed % 3 == 0 else "descending_a",
    )
    want = LocalScheduler(SchedulerSettings()).select(requests, trees, params)
    assert_same_selection(client.select(requests, trees, params), want)
    assert_same_selection(want, select(requests, trees, params))
    assert client.last_timing is not None and client.last_timing.compute_us >= 0


def test_progress_columns_select_like_a_list() -> None:
    # The server hands select() the wire's columns (ProgressBatch), never per-request
    # objects; both forms must give the same answer and the same errors.
    requests, trees = random_batch(np.random.default_rng(7), 12)
    columns = progress_from_pb(progress_to_pb(requests))
    assert list(columns) == requests and columns[-1] == requests[-1]
    params = SelectionParams(budget=40, depth=5, t_spec_ms=25.0)
    assert_same_selection(select(columns, trees, params), select(requests, trees, params))
    bad = ProgressBatch(["p", "q"], np.array([5.0, -1.0]), np.zeros(2), np.zeros(2, np.int64))
    with pytest.raises(SelectionError, match=r"requests\[1\].tpot_slo_ms.*'q'"):
        select(bad, [CandidateTree.root_only(1)] * 2, params)


def test_optimal_invalid_travels(client: GrpcScheduler) -> None:
    # One root-only tree cannot reach A(r) = 3: no feasible allocation.
    requests = [RequestProgress("x", 10.0, 20.0, 0)]
    params = SelectionParams(budget=4, depth=3, t_spec_ms=10.0, policy="optimal")
    got = client.select(requests, [CandidateTree.root_only(7)], params)
    assert got.invalid and got.selected == [] and got.budget_used == 0
    assert got.a.tolist() == [3.0]


def test_empty_batch(client: GrpcScheduler) -> None:
    got = client.select([], [], SelectionParams(budget=1, depth=2, t_spec_ms=1.0))
    assert got.selected == [] and got.budget_used == 0


def test_plan_matches_local(client: GrpcScheduler) -> None:
    local = LocalScheduler(SchedulerSettings())
    for n in (0, 1, 2, 8, 32, 128, 1000):
        assert client.plan(n) == local.plan(n)
    with GrpcScheduler(client.address, SchedulerSettings(budget=512), timeout_s=5.0) as big:
        assert big.plan(8) == LocalScheduler(SchedulerSettings(budget=512)).plan(8)


# ---- malformed input ------------------------------------------------------------------


def good_request(**changes: object) -> scheduler_pb2.SelectRequest:
    """Two requests with trees of 3 and 1 nodes, then `changes` applied ("trees.x" and
    "requests.x" name fields of the nested messages)."""
    msg = scheduler_pb2.SelectRequest(
        requests=common_pb2.RequestProgressBatch(
            ids=["a", "b"],
            tpot_slo_ms=packed([50, 20], F64),
            elapsed_ms=packed([100, 100], F64),
            decoded=packed([1, 1], I64),
        ),
        trees=common_pb2.CandidateTreeBatch(
            sizes=packed([3, 1], I32),
            tokens=packed([5, 6, 7, 8], I32),
            parents=packed([-1, 0, 1, -1], I32),
            logprobs=packed([0, -0.5, -0.5, 0], F32),
        ),
        budget=4,
        depth=2,
        t_spec_ms=10,
    )
    for key, value in changes.items():
        target, _, name = key.rpartition(".")
        owner = getattr(msg, target) if target else msg
        if isinstance(value, list):  # repeated fields are replaced in place
            del getattr(owner, name)[:]
            getattr(owner, name).extend(value)
        else:
            setattr(owner, name, value)
    return msg


BAD = {
    "parent out of range": ({"trees.parents": packed([-1, 0, 7, -1], I32)}, "parents"),
    "parent not topological": ({"trees.parents": packed([-1, 2, 0, -1], I32)}, "topolog"),
    "negative parent": ({"trees.parents": packed([-1, 0, -1, -1], I32)}, "parents"),
    "root with a parent": ({"trees.parents": packed([-1, 0, 1, 0], I32)}, "root"),
    "positive logprob": ({"trees.logprobs": packed([0, 0.5, -0.5, 0], F32)}, "positive"),
    "NaN logprob": ({"trees.logprobs": packed([0, np.nan, -0.5, 0], F32)}, "NaN"),
    "empty tree": ({"trees.sizes": packed([4, 0], I32)}, "empty"),
    "zero SLO": ({"requests.tpot_slo_ms": packed([50, 0], F64)}, "requests[1].tpot_slo_ms"),
    "negative SLO": ({"requests.tpot_slo_ms": packed([-5, 9], F64)}, "requests[0].tpot_slo_ms"),
    "NaN SLO": ({"requests.tpot_slo_ms": packed([50, np.nan], F64)}, "tpot_slo_ms"),
    "negative elapsed": ({"requests.elapsed_ms": packed([1, -1], F64)}, "elapsed_ms"),
    "negative decoded": ({"requests.decoded": packed([-1, 1], I64)}, "decoded"),
    "progress lengths disagree": ({"requests.decoded": packed([1], I64)}, "requests.decoded"),
    "ragged progress bytes": ({"requests.elapsed_ms": b"\x00" * 12}, "8-byte"),
    "fewer ids than values": ({"requests.ids": ["a"]}, "requests"),
    "zero budget": ({"budget": 0}, "budget"),
    "negative budget": ({"budget": -3}, "budget"),
    "budget below roots": ({"budget": 1}, "budget"),
    "negative depth": ({"depth": -1}, "depth"),
    "NaN t_spec": ({"t_spec_ms": float("nan")}, "t_spec_ms"),
    "zero n_max": ({"n_max": 0}, "n_max"),
    "lengths disagree": ({"trees.tokens": packed([5, 6, 7], I32)}, "lengths disagree"),
    "sizes disagree": ({"trees.sizes": packed([3, 2], I32)}, "lengths disagree"),
    "ragged bytes": ({"trees.logprobs": b"\x00" * 15}, "4-byte"),
    "more trees than requests": ({"trees.sizes": packed([2, 1, 1], I32)}, "requests"),
    "unknown policy": ({"policy": 99}, "policy"),
    "unknown order": ({"order": 7}, "order"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_select_is_invalid_argument(
    stub: scheduler_pb2_grpc.SchedulerStub, case: str
) -> None:
    changes, needle = BAD[case]
    stub.Select(good_request(), timeout=5)  # the baseline is valid
    with pytest.raises(grpc.RpcError) as info:
        stub.Select(good_request(**changes), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details(), info.value.details()


@pytest.mark.parametrize("missing", ["trees", "requests"])
def test_missing_trees_or_requests(stub: scheduler_pb2_grpc.SchedulerStub, missing: str) -> None:
    msg = good_request()
    msg.ClearField(missing)
    with pytest.raises(grpc.RpcError) as info:
        stub.Select(msg, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests" in info.value.details()


@pytest.mark.parametrize(
    ("request_", "needle"),
    [(scheduler_pb2.PlanRequest(n=-1), "n:"), (scheduler_pb2.PlanRequest(n=4, budget=0), "budget")],
)
def test_malformed_plan_is_invalid_argument(
    stub: scheduler_pb2_grpc.SchedulerStub, request_: scheduler_pb2.PlanRequest, needle: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Plan(request_, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


def test_client_raises_selection_error_for_bad_input(client: GrpcScheduler) -> None:
    requests = [RequestProgress("z", 0.0, 1.0, 0)]
    with pytest.raises(SelectionError, match=r"requests\[0\].tpot_slo_ms"):
        client.select(requests, [CandidateTree.root_only(1)], SelectionParams(4, 2, 1.0))
    with pytest.raises(SelectionError, match="policy"):
        client.select(
            requests, [CandidateTree.root_only(1)], SelectionParams(4, 2, 1.0, policy="fastest")
        )


def test_unreachable_service_is_a_connection_error() -> None:
    with GrpcScheduler("127.0.0.1:1", timeout_s=1.0) as dead, pytest.raises(ConnectionError):
        dead.plan(4)
    assert issubclass(ServiceUnavailable, ConnectionError)


# ---- health and reflection ------------------------------------------------------------


def test_health_serving(server: BackgroundServer) -> None:
    assert type(server.loop).__module__.startswith("uvloop")
    with insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(server: BackgroundServer) -> None:
    with insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


# ---- the command line -----------------------------------------------------------------


def adaserve_command() -> list[str]:
    script = Path(sys.executable).with_name("adaserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "adaserve.cli"]


def test_cli_serves_and_stops_gracefully_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "scheduler.yaml"
    config.write_text("scheduler:\n  budget: 48\n  policy: global\n")
    proc = subprocess.Popen(
        [
            *adaserve_command(),
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--config",
            str(config),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), (line, proc.stderr.read())
        address = line.split()[-1]
        with GrpcScheduler(address, timeout_s=5.0) as remote:
            remote.wait_ready(10)
            # The config file reached the server: an UNSPECIFIED policy means "global"
            # there, and Plan without a budget uses 48.
            requests, trees = random_batch(np.random.default_rng(1), 5)
            params = SelectionParams(20, 4, 20.0, policy="global")
            msg = select_request_to_pb(requests, trees, params)
            msg.ClearField("policy")
            with insecure_channel(address) as channel:
                reply = scheduler_pb2_grpc.SchedulerStub(channel).Select(msg, timeout=5)
            assert_same_selection(
                selection_from_pb(reply.selection), select(requests, trees, params)
            )
            assert remote.plan(8) == LocalScheduler(SchedulerSettings(budget=48)).plan(8)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
