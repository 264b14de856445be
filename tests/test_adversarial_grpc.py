"""Every gRPC service fed malformed and adversarial messages while good traffic flows.

One serving unit on loopback (real gRPC servers in this process): the verifier's engine
drafts through the drafter service and selects through the scheduler service, so the
garbage sent to either lands on the very servers the good requests use. Each bad message
must be answered INVALID_ARGUMENT or NOT_FOUND (a few are well-defined no-ops, noted
where listed), every server must stay healthy, and the good requests running meanwhile
must all finish with the target's own greedy output: no poisoned batch.

The other direction too: the drafter and scheduler servers can be switched to corrupt
their answers (as a compromised or version-skewed pod would); the engine must notice,
fall back, and still produce exactly the target's output.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adaserve import metrics
from adaserve.config import SchedulerSettings, Settings
from adaserve.engine import Engine
from adaserve.model.loader import load_runner, load_tokenizer
from adaserve.rpc.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, scheduler_pb2
from adaserve.rpc.v1 import scheduler_pb2_grpc as sgrpc
from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from adaserve.speculate import BeamDrafter
from services.common.convert import F32, F64, I32, I64, packed
from services.common.options import insecure_channel
from services.common.server import BackgroundServer, GrpcServer, Service
from services.drafter.server import SERVICE_NAME as DRAFTER_SERVICE
from services.drafter.server import DrafterServicer
from services.scheduler.server import SERVICE_NAME as SCHEDULER_SERVICE
from services.scheduler.server import SchedulerServicer
from services.verifier.server import build_server as verifier_server
from services.verifier.wiring import build_engine
from tests._faults import greedy_reference_ignore_eos, greedy_request
from tests._serving import VOCAB, make_served_model

pytestmark = pytest.mark.slow  # ~20 s to build the unit on 2 shared cores

INVALID = {grpc.StatusCode.INVALID_ARGUMENT}
INVALID_OR_MISSING = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
OK = {grpc.StatusCode.OK}  # documented no-ops (idempotent releases and aborts)
GOOD_PROMPTS = [[10, 11, 12, 13], [40, 41], [70, 3, 70, 3, 70], [5]]
GOOD_TOKENS = 40


class HostileDrafter(DrafterServicer):
    """The real drafter servicer, whose answers `mode` corrupts on demand."""

    mode: str | None = None

    async def Speculate(
        self, request: drafter_pb2.SpeculateRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.SpeculateResponse:
        reply = await super().Speculate(request, context)
        if self.mode is not None and reply.trees.sizes:
            reply.trees.CopyFrom(corrupt_trees(reply.trees, self.mode))
        return reply


def corrupt_trees(msg: common_pb2.CandidateTreeBatch, mode: str) -> common_pb2.CandidateTreeBatch:
    sizes = np.frombuffer(msg.sizes, I32).copy()
    tokens = np.frombuffer(msg.tokens, I32).copy()
    parents = np.frombuffer(msg.parents, I32).copy()
    roots = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    inner = np.setdiff1d(np.arange(tokens.shape[0]), roots)  # non-root nodes
    if mode == "wrong root":
        tokens[roots] = (tokens[roots] + 1) % VOCAB
    elif mode == "token past the vocabulary" and inner.size:
        tokens[inner[0]] = VOCAB + 7
    elif mode == "parent out of range" and inner.size:
        parents[inner[-1]] = 10_000
    elif mode == "a tree short":
        sizes, n = sizes[:-1], int(sizes[:-1].sum())
        tokens, parents = tokens[:n], parents[:n]
        return common_pb2.CandidateTreeBatch(
            sizes=packed(sizes, I32),
            tokens=packed(tokens, I32),
            parents=packed(parents, I32),
            logprobs=msg.logprobs[: 4 * n],
        )
    return common_pb2.CandidateTreeBatch(
        sizes=msg.sizes,
        tokens=packed(tokens, I32),
        parents=packed(parents, I32),
        logprobs=msg.logprobs,
    )


class HostileScheduler(SchedulerServicer):
    """The real scheduler servicer, whose selections `mode` corrupts on demand."""

    mode: str | None = None

    async def Select(
        self, request: scheduler_pb2.SelectRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SelectResponse:
        reply = await super().Select(request, context)
        if self.mode is not None:
            tree_sizes = np.frombuffer(request.trees.sizes, I32)
            reply.selection.CopyFrom(corrupt_selection(reply.selection, tree_sizes, self.mode))
        return reply


def corrupt_selection(
    msg: common_pb2.Selection, tree_sizes: np.ndarray, mode: str
) -> common_pb2.Selection:
    sizes = np.frombuffer(msg.sizes, I32)
    flat = np.frombuffer(msg.selected, I32)
    parts = np.split(flat, np.cumsum(sizes)[:-1])
    if mode == "root missing":
        parts = [p[1:] if p.shape[0] > 1 else p + 1 for p in parts]
    elif mode == "node past the tree":
        parts = [np.append(p, 10_000) for p in parts]
    elif mode == "not closed under parent":  # the root and a deepest node, alone
        parts = [np.array([0, s - 1]) if s > 2 else np.array([0]) for s in tree_sizes]
    elif mode == "descending":
        parts = [p[::-1] for p in parts]
    elif mode == "a selection short":
        parts = parts[:-1]
    out = common_pb2.Selection()
    out.CopyFrom(msg)
    out.sizes = packed([p.shape[0] for p in parts], I32)
    out.selected = packed(np.concatenate(parts) if parts else np.zeros(0), I32)
    return out


DRAFTER_CORRUPTIONS = [
    "wrong root",
    "token past the vocabulary",
    "parent out of range",
    "a tree short",
]
SCHEDULER_CORRUPTIONS = [
    "root missing",
    "node past the tree",
    "not closed under parent",
    "descending",
    "a selection short",
]


def serve(
    name: str, servicer: object, add: Callable[[object, grpc.aio.Server], None]
) -> BackgroundServer:
    return BackgroundServer(
        lambda: GrpcServer([Service(name, lambda s: add(servicer, s))], "127.0.0.1", 0)
    )


@dataclass
class Unit:
    verifier: BackgroundServer
    drafter: BackgroundServer
    scheduler: BackgroundServer
    engine: Engine
    refs: list[list[int]]
    hostile_drafter: HostileDrafter
    hostile_scheduler: HostileScheduler
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def channel(self, name: str) -> grpc.Channel:
        if name not in self.channels:
            server = getattr(self, name)
            self.channels[name] = insecure_channel(server.address)
        return self.channels[name]


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unit]:
    target = make_served_model(tmp_path_factory.mktemp("adversarial") / "target")
    hostile_drafter = HostileDrafter(
        BeamDrafter(load_runner(target, device="cpu", dtype="float32", kv_blocks=2048))
    )
    hostile_scheduler = HostileScheduler(SchedulerSettings())
    drafter = serve(
        DRAFTER_SERVICE, hostile_drafter, drafter_pb2_grpc.add_DrafterServicer_to_server
    )
    scheduler = serve(SCHEDULER_SERVICE, hostile_scheduler, sgrpc.add_SchedulerServicer_to_server)
    drafter.start()
    scheduler.start()
    settings = Settings(
        model={"target": str(target), "drafter": None, "device": "cpu", "dtype": "float32"},
        services={"drafter": drafter.address, "scheduler": scheduler.address},
        # Generous timeouts: on a loaded CI machine a slow call must not hide in a fallback.
        engine={"kv_memory_gb": 0.05, "max_running": 8, "max_queue": 16}
        | {"speculation_timeout_ms": 5000, "scheduler_timeout_ms": 5000},
        slo={"baseline_tpot_ms": 20.0},
        # every Select to the hostile service (auto would select in-process, where that
        # is faster, and meet its answers only on a probe)
        scheduler={"remote_select": "always"},
    )
    engine = build_engine(settings)
    engine.start()
    tokenizer = load_tokenizer(Path(target))
    verifier = BackgroundServer(
        lambda: verifier_server(engine, settings, "127.0.0.1", 0, tokenizer)
    )
    verifier.start()
    refs = [greedy_reference_ignore_eos(target, p, GOOD_TOKENS) for p in GOOD_PROMPTS]
    u = Unit(verifier, drafter, scheduler, engine, refs, hostile_drafter, hostile_scheduler)
    try:
        yield u
    finally:
        for ch in u.channels.values():
            ch.close()
        verifier.stop()
        engine.stop()
        drafter.stop()
        scheduler.stop()


class GoodTraffic:
    """Greedy requests back to back on a thread while the attack runs; every output
    is compared with the target's own."""

    def __init__(self, unit: Unit, streams: int = 2) -> None:
        self.unit = unit
        self.stub = vgrpc.VerifierStub(unit.channel("verifier"))
        self.done = 0
        self.failures: list[str] = []
        self.live_ids: set[str] = set()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(streams)]

    def _run(self, k: int) -> None:
        n = 0
        while not self._stop.is_set() or n == 0:
            i = (k + n) % len(GOOD_PROMPTS)
            rid = f"good-{k}-{n}"
            self.live_ids.add(rid)
            try:
                # The draft model every time: `auto` may serve a request from the n-gram
                # drafter alone, and a hostile drafter nobody asks is never noticed.
                model = vpb.SPECULATION_METHOD_MODEL
                req = greedy_request(rid, GOOD_PROMPTS[i], GOOD_TOKENS, speculation_method=model)
                chunks = list(self.stub.Generate(req, timeout=60))
                tokens = [t for c in chunks for t in c.token_ids]
                if (
                    tokens != self.unit.refs[i]
                    or chunks[-1].finish_reason != vpb.FINISH_REASON_LENGTH
                ):
                    self.failures.append(f"{rid}: {tokens} != {self.unit.refs[i]}")
                else:
                    self.done += 1
            except grpc.RpcError as err:
                self.failures.append(f"{rid}: {err.code().name} {err.details()}")
            finally:
                self.live_ids.discard(rid)
            n += 1

    def __enter__(self) -> GoodTraffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        result = call()
        if isinstance(result, Iterator):
            list(result)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def assert_answers(cases: dict[str, tuple[Callable[[], object], set[grpc.StatusCode]]]) -> None:
    wrong = {}
    for name, (call, expected) in cases.items():
        code = code_of(call)
        if code not in expected:
            wrong[name] = code.name
    assert not wrong, wrong


def assert_all_healthy(unit: Unit) -> None:
    for name in ("verifier", "drafter", "scheduler"):
        reply = health_pb2_grpc.HealthStub(unit.channel(name)).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    assert unit.engine.loop_alive


# ---- the verifier ---------------------------------------------------------------------


def generate(**fields: object) -> vpb.GenerateRequest:
    """A valid greedy request, then `fields` applied ("sampling.x" for sampling)."""
    req = greedy_request("bad", [1, 2, 3], 8)
    for key, value in fields.items():
        owner, _, name = key.rpartition(".")
        target = getattr(req, owner) if owner else req
        if name == "token_ids":
            req.token_ids.ids[:] = value  # type: ignore[index]
        elif isinstance(value, list):
            del getattr(target, name)[:]
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return req


NAN, INF = float("nan"), float("inf")
BAD_GENERATE: dict[str, vpb.GenerateRequest] = {
    "no prompt": vpb.GenerateRequest(request_id="bad", sampling=vpb.SamplingParams(max_tokens=4)),
    "empty text": generate(text=""),
    "empty token ids": generate(token_ids=[]),
    "negative token id": generate(token_ids=[1, -7]),
    "token id past the vocabulary": generate(token_ids=[1, VOCAB]),
    "token id 2^31-1": generate(token_ids=[2**31 - 1]),
    "a million-token prompt": generate(token_ids=[5] * 1_000_000),
    "negative max_tokens": generate(**{"sampling.max_tokens": -1}),
    "max_tokens 2^31-1": generate(**{"sampling.max_tokens": 2**31 - 1}),
    "NaN temperature": generate(**{"sampling.temperature": NAN}),
    "infinite temperature": generate(**{"sampling.temperature": INF}),
    "negative temperature": generate(**{"sampling.temperature": -1.0}),
    "NaN top_p": generate(**{"sampling.top_p": NAN}),
    "top_p above 1": generate(**{"sampling.top_p": 1.5}),
    "negative top_k": generate(**{"sampling.top_k": -3}),
    "negative stop token id": generate(**{"sampling.stop_token_ids": [-1]}),
    "empty stop string": generate(**{"sampling.stop": ["ok", ""]}),
    "NaN SLO": generate(tpot_slo_ms=NAN),
    "negative SLO": generate(tpot_slo_ms=-5.0),
    "infinite SLO": generate(tpot_slo_ms=INF),
    "unknown SLO class": generate(tpot_slo_ms=0.0, slo_class="no-such-class"),
    "NaN timeout": generate(timeout_s=NAN),
    "negative timeout": generate(timeout_s=-1.0),
    "empty request id": generate(request_id=""),
}


def test_verifier_rejects_malformed_requests_without_harm(unit: Unit) -> None:
    stub = vgrpc.VerifierStub(unit.channel("verifier"))
    cases = {
        name: (lambda r=req: stub.Generate(r, timeout=30), INVALID)
        for name, req in BAD_GENERATE.items()
    }
    # Ids nobody holds: aborting one is a no-op (as cancelling a finished call is).
    cases["abort of an unknown id"] = (
        lambda: stub.Abort(vpb.AbortRequest(request_id="never-seen"), timeout=5),
        OK,
    )
    with GoodTraffic(unit) as good:
        assert_answers(cases)
    assert good.failures == [] and good.done >= 1
    assert_all_healthy(unit)


def test_a_live_request_id_cannot_be_taken_over(unit: Unit) -> None:
    """A second request under the id of one in flight is refused; the first one's KV
    sequence is untouched and it completes with the right output."""
    stub = vgrpc.VerifierStub(unit.channel("verifier"))
    first = stub.Generate(greedy_request("dup", GOOD_PROMPTS[0], GOOD_TOKENS), timeout=60)
    chunks = [next(first)]  # admitted
    clash = code_of(lambda: stub.Generate(greedy_request("dup", GOOD_PROMPTS[1], 5), timeout=30))
    assert clash == grpc.StatusCode.INVALID_ARGUMENT
    chunks += list(first)
    assert [t for c in chunks for t in c.token_ids] == unit.refs[0]
    assert_all_healthy(unit)


# ---- the drafter ----------------------------------------------------------------------


def speculate(updates: list[tuple[str, list[int] | bytes, int]], depth: int = 2, width: int = 2):
    return drafter_pb2.SpeculateRequest(
        updates=[
            drafter_pb2.DraftUpdate(
                id=rid,
                new_tokens=tokens if isinstance(tokens, bytes) else packed(tokens, I32),
                total_len=total,
            )
            for rid, tokens, total in updates
        ],
        depth=depth,
        width=width,
    )


BAD_SPECULATE = {
    "ragged token bytes": speculate([("x", b"\x01\x00\x00", 1)]),
    "negative total_len": speculate([("x", [1, 2], -2)]),
    "total_len below the tokens sent": speculate([("x", [1, 2, 3], 2)]),
    "negative token id": speculate([("x", [1, -5], 2)]),
    "token id past the vocabulary": speculate([("x", [1, VOCAB + 100], 2)]),
    "negative depth": speculate([("x", [1, 2], 2)], depth=-1),
    "zero width": speculate([("x", [1, 2], 2)], width=0),
    "negative width": speculate([("x", [1, 2], 2)], width=-4),
    "width 2^31-1": speculate([("x", [1, 2], 2)], width=2**31 - 1),
    "empty id": speculate([("", [1, 2], 2)]),
    "duplicate ids": speculate([("x", [1, 2], 2), ("x", [3], 1)]),
}


def test_drafter_rejects_malformed_requests_without_harm(unit: Unit) -> None:
    stub = drafter_pb2_grpc.DrafterStub(unit.channel("drafter"))
    cases = {
        name: (lambda m=msg: stub.Speculate(m, timeout=30), INVALID)
        for name, msg in BAD_SPECULATE.items()
    }
    cases["release of unknown ids"] = (
        lambda: stub.Release(drafter_pb2.ReleaseRequest(ids=["nope"] * 1000), timeout=5),
        OK,
    )
    with GoodTraffic(unit) as good:
        assert_answers(cases)
    assert good.failures == [] and good.done >= 1
    assert_all_healthy(unit)


def test_drafter_state_tampering_never_changes_an_output(unit: Unit) -> None:
    """A compromised peer releases the live requests' draft state and feeds garbage
    under their ids: the engine sees lost or inconsistent state, re-syncs, and the
    verifier's check keeps every output exactly the target's."""
    stub = drafter_pb2_grpc.DrafterStub(unit.channel("drafter"))
    rng = np.random.default_rng(0)
    resyncs = metrics.drafter_resyncs_total._value.get()
    attacks = 0
    with GoodTraffic(unit, streams=3) as good:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            ids = sorted(good.live_ids)
            time.sleep(0.02)
            if not ids:
                continue
            stub.Release(drafter_pb2.ReleaseRequest(ids=ids[:1]), timeout=10)
            garbage = [(rid, rng.integers(0, VOCAB, 3).tolist(), 50) for rid in ids[1:2]]
            if garbage:
                code_of(lambda g=garbage: stub.Speculate(speculate(g), timeout=10))
            attacks += 1
    assert attacks >= 10
    assert good.failures == [] and good.done >= 3
    assert metrics.drafter_resyncs_total._value.get() > resyncs  # the engine noticed
    assert_all_healthy(unit)


def test_drafter_survives_a_huge_update(unit: Unit) -> None:
    """8 M tokens (32 MB) for one id: past the drafter's context, so answered with a
    root-only tree (or refused), never a crash; the state is then released."""
    stub = drafter_pb2_grpc.DrafterStub(unit.channel("drafter"))
    n = 8_000_000
    msg = speculate([("huge", np.full(n, 7, np.int32).tobytes(), n)], depth=3, width=2)
    code = code_of(lambda: stub.Speculate(msg, timeout=60))
    assert code in OK | INVALID
    stub.Release(drafter_pb2.ReleaseRequest(ids=["huge"]), timeout=10)
    assert_all_healthy(unit)


# ---- the scheduler --------------------------------------------------------------------


def select(n: int = 2, **changes: object) -> scheduler_pb2.SelectRequest:
    """n requests with 3-node chain trees, then `changes` applied."""
    msg = scheduler_pb2.SelectRequest(
        requests=common_pb2.RequestProgressBatch(
            ids=[f"r{i}" for i in range(n)],
            tpot_slo_ms=packed(np.full(n, 50.0), F64),
            elapsed_ms=packed(np.full(n, 100.0), F64),
            decoded=packed(np.ones(n), I64),
        ),
        trees=common_pb2.CandidateTreeBatch(
            sizes=packed(np.full(n, 3), I32),
            tokens=packed(np.tile([5, 6, 7], n), I32),
            parents=packed(np.tile([-1, 0, 1], n), I32),
            logprobs=packed(np.tile([0.0, -0.5, -0.5], n), F32),
        ),
        budget=4 * n,
        depth=2,
        t_spec_ms=10.0,
    )
    for key, value in changes.items():
        owner, _, name = key.rpartition(".")
        target = getattr(msg, owner) if owner else msg
        if isinstance(value, list):
            del getattr(target, name)[:]
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return msg


I64_MAX = 2**63 - 1
BAD_SELECT = {
    "infinite SLO": select(**{"requests.tpot_slo_ms": packed([50.0, INF], F64)}),
    "infinite elapsed": select(**{"requests.elapsed_ms": packed([INF, 1.0], F64)}),
    "NaN elapsed": select(**{"requests.elapsed_ms": packed([NAN, 1.0], F64)}),
    "infinite t_spec": select(t_spec_ms=INF),
    "negative t_spec": select(t_spec_ms=-1.0),
    "negative n_max": select(n_max=-1),
    "negative tree size": select(**{"trees.sizes": packed([4, -1], I32)}),
    "sizes overflowing int32": select(**{"trees.sizes": packed([2**31 - 1, 2**31 - 1], I32)}),
    "token ids negative": select(**{"trees.tokens": packed([5, -6, 7, 5, 6, 7], I32)}),
    "logprob -inf": select(**{"trees.logprobs": packed([0, -INF, -0.5, 0, -0.5, -0.5], F32)}),
    "logprob NaN at a root": select(**{"trees.logprobs": packed([NAN, -0.5, -0.5] * 2, F32)}),
}

# Extreme but well defined: selection is a pure function of numbers, and ids are only
# labels. These must be answered normally, each request keeping at least its root.
ODD_SELECT = {
    "decoded near int64 max": select(**{"requests.decoded": packed([I64_MAX, 1], I64)}),
    "budget int64 max": select(budget=I64_MAX),
    "depth 2^31-1": select(depth=2**31 - 1),
    "duplicate request ids": select(**{"requests.ids": ["r0", "r0"]}),
    "empty request id": select(**{"requests.ids": ["", "r1"]}),
}


def test_scheduler_rejects_malformed_requests_without_harm(unit: Unit) -> None:
    stub = sgrpc.SchedulerStub(unit.channel("scheduler"))
    cases = {
        name: (lambda m=msg: stub.Select(m, timeout=30), INVALID)
        for name, msg in BAD_SELECT.items()
    }
    cases["plan for a negative batch"] = (
        lambda: stub.Plan(scheduler_pb2.PlanRequest(n=-5), timeout=5),
        INVALID,
    )
    cases["plan with a negative budget"] = (
        lambda: stub.Plan(scheduler_pb2.PlanRequest(n=4, budget=-1), timeout=5),
        INVALID,
    )
    with GoodTraffic(unit) as good:
        assert_answers(cases)
        for name, msg in ODD_SELECT.items():
            sizes = np.frombuffer(stub.Select(msg, timeout=30).selection.sizes, dtype=I32)
            assert sizes.tolist() == [3, 3], name
    assert good.failures == [] and good.done >= 1
    assert_all_healthy(unit)


def test_scheduler_handles_a_huge_batch(unit: Unit) -> None:
    """200k requests in one Select (a ~15 MB message) are answered, not a crash."""
    stub = sgrpc.SchedulerStub(unit.channel("scheduler"))
    reply = stub.Select(select(200_000), timeout=120)
    sizes = np.frombuffer(reply.selection.sizes, dtype=I32)
    assert sizes.shape == (200_000,) and (sizes >= 1).all()
    assert_all_healthy(unit)


# ---- hostile answers --------------------------------------------------------------------


def _under_hostile(
    unit: Unit, servicer: HostileDrafter | HostileScheduler, mode: str, component: str
) -> None:
    settle(unit)  # both services in use again after the previous case's fallbacks
    before = metrics.fallbacks_total.labels(component)._value.get()
    servicer.mode = mode
    try:
        with GoodTraffic(unit) as good:
            deadline = time.monotonic() + 30
            while good.done < 3 and not good.failures and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        servicer.mode = None
    assert good.failures == [] and good.done >= 3
    assert metrics.fallbacks_total.labels(component)._value.get() > before  # noticed
    assert_all_healthy(unit)


def settle(unit: Unit, timeout_s: float = 20.0) -> None:
    stub = vgrpc.VerifierStub(unit.channel("verifier"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = unit.engine.stats()
        if stats.drafter_healthy and stats.scheduler_healthy:
            return
        list(stub.Generate(greedy_request("settle", GOOD_PROMPTS[0], 8), timeout=30))
        time.sleep(0.2)
    raise AssertionError("the engine did not return to its drafter and scheduler")


@pytest.mark.parametrize("mode", DRAFTER_CORRUPTIONS)
def test_corrupt_drafter_answers_never_change_an_output(unit: Unit, mode: str) -> None:
    _under_hostile(unit, unit.hostile_drafter, mode, "drafter")


@pytest.mark.parametrize("mode", SCHEDULER_CORRUPTIONS)
def test_corrupt_scheduler_answers_never_change_an_output(unit: Unit, mode: str) -> None:
    _under_hostile(unit, unit.hostile_scheduler, mode, "scheduler")
