"""The EAGLE drafter behind the real drafter gRPC service on loopback, the embedded
SmolLM2 target in the engine: the verifier learns the head's feature layers from the
service, features cross the wire (their bytes per iteration measured), bad payloads
are INVALID_ARGUMENT, and greedy output equals the target's own, also with the
drafter killed mid-stream and restarted (the verifier recomputes the features)."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest
import torch

from adaserve.config import load_settings
from adaserve.drafter import DraftUpdate
from adaserve.eagle_drafter import EagleDrafter
from adaserve.engine import Engine
from adaserve.model.eagle import load_eagle_runner
from adaserve.model.loader import load_runner, load_tokenizer
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.rpc.v1 import drafter_pb2, drafter_pb2_grpc
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
from services.common.convert import I32, packed, speculate_request_to_pb
from services.common.options import insecure_channel
from services.common.server import BackgroundServer
from services.drafter.client import GrpcDrafter
from services.drafter.server import build_server
from tests._eagle import make_eagle_dir
from tests._spec_loop import generate
from tests._stats import single_thread

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
LAYERS = (1, 15, 29)
DIM = len(LAYERS) * 576
TEXTS = ["The capital of France is", "def add(a, b):", "Write a haiku about rain."]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def smol(embedded_dir, tmp_path_factory):
    tok = load_tokenizer("embedded")
    prompts = {f"p{k}": tok(t)["input_ids"] for k, t in enumerate(TEXTS)}
    target = load_runner(embedded_dir, device="cpu", dtype="float32", kv_blocks=256)
    ref, _ = generate(target, prompts, MAX_TOKENS)
    head = make_eagle_dir(tmp_path_factory.mktemp("eagle"), embedded_dir, feature_layers=LAYERS)
    return target, head, prompts, ref


def _server(head, port=0):
    def build():
        runner = load_eagle_runner(head, torch.device("cpu"), torch.float32, kv_blocks=256)
        return build_server(EagleDrafter(runner), "127.0.0.1", port)

    return BackgroundServer(build)


def _update(tokens, hidden=None, dtype=None, rows=None, cols=None, raw=None):
    u = drafter_pb2.DraftUpdate(id="u", new_tokens=packed(tokens, I32), total_len=len(tokens))
    if hidden is not None:
        u.hidden = raw if raw is not None else hidden.tobytes()
        u.hidden_rows = hidden.shape[0] if rows is None else rows
        u.hidden_cols = hidden.shape[1] if cols is None else cols
        u.hidden_dtype = drafter_pb2.HIDDEN_DTYPE_FLOAT16 if dtype is None else dtype
    return drafter_pb2.SpeculateRequest(updates=[u], depth=2, width=2)


def test_wire_checks_are_invalid_argument(smol):
    _, head, _, _ = smol
    tokens = [1, 2, 3]
    good = np.zeros((3, DIM), np.float16)
    bad = {
        "missing": (_update(tokens), "needs hidden"),
        "rows": (_update(tokens, np.zeros((2, DIM), np.float16)), "hidden shape"),
        "cols": (_update(tokens, np.zeros((3, DIM - 1), np.float16)), "hidden shape"),
        "dtype": (_update(tokens, good, dtype=0), "hidden_dtype"),
        "unknown dtype": (_update(tokens, good, dtype=7), "hidden_dtype"),
        "truncated": (_update(tokens, good, raw=good.tobytes()[:-2]), "bytes for"),
        "shape lies": (_update(tokens, good, rows=4), "bytes for"),
        "non-finite": (_update(tokens, np.full((3, DIM), np.inf, np.float16)), "non-finite"),
    }
    with _server(head) as server, insecure_channel(server.address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for case, (msg, needle) in bad.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.Speculate(msg, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            assert needle in info.value.details(), (case, info.value.details())
        assert stub.Stats(drafter_pb2.StatsRequest(), timeout=5).num_sequences == 0
        ok = stub.Speculate(_update(tokens, good), timeout=30)
        assert not ok.lost_ids and ok.HasField("trees")
        stats = stub.Stats(drafter_pb2.StatsRequest(), timeout=5)
        assert stats.kind == "eagle" and list(stats.feature_layers) == list(LAYERS)
        assert stats.feature_dim == DIM


def test_remote_trees_match_in_process(smol):
    target, head, _, _ = smol
    local = EagleDrafter(load_eagle_runner(head, target.device, target.dtype, kv_blocks=256))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, 9).astype(np.int32)
    for dtype in (np.float16, np.float32):
        hidden = rng.standard_normal((9, DIM)).astype(dtype)
        u = [DraftUpdate(f"x{dtype.__name__}", tokens, 9, hidden=hidden)]
        with _server(head) as server, GrpcDrafter(server.address, timeout_s=30) as client:
            client.describe()
            assert client.kind == "eagle" and client.spec.feature_layers == LAYERS
            got = client.speculate(u, 3, 2)
        want = local.speculate(u, 3, 2)
        assert [t.tokens.tolist() for t in got] == [t.tokens.tolist() for t in want]
        np.testing.assert_allclose(got[0].logprobs, want[0].logprobs, rtol=1e-4, atol=1e-4)


class Measured(GrpcDrafter):
    """The client, counting the feature bytes and whole messages it sends."""

    calls: list[tuple[int, int, int]]  # (hidden bytes, message bytes, decoding updates)
    answered: list[list[DraftUpdate]]  # the calls it answered with trees

    def speculate(self, updates, depth, width, stop_prob=0.0):
        msg = speculate_request_to_pb(updates, depth, width, stop_prob)
        hidden = sum(len(u.hidden) for u in msg.updates)
        self.calls.append((hidden, msg.ByteSize(), sum(not u.ingest for u in updates)))
        trees = super().speculate(updates, depth, width, stop_prob)
        self.answered.append(updates)
        return trees


def _engine(target, drafter):
    settings = load_settings(
        None,
        slo={"baseline_tpot_ms": 50.0},
        engine={"kv_blocks": 256, "max_batch_tokens": 40, "speculation_timeout_ms": 5000},
        scheduler={"budget": 16},
    )
    return Engine(
        RunnerTarget(target, eos_token_ids=()),
        drafter,
        LocalScheduler(settings.scheduler),
        settings,
    )


def test_greedy_through_the_service_with_the_drafter_killed_mid_stream(smol):
    target, head, prompts, ref = smol
    first = _server(head)
    port = first.start()
    client = Measured(f"127.0.0.1:{port}", timeout_s=5.0)
    client.calls, client.answered = [], []
    client.describe()
    engine = _engine(target, client)
    assert engine.drafter_kind == "eagle"
    reqs = [
        GenerationRequest(
            k,
            tuple(prompts[k]),
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            slo,
            speculation="eagle",
        )
        for k, slo in zip(prompts, (30.0, 80.0, 300.0), strict=True)
    ]
    streams = {r.id: engine.submit(r) for r in reqs}
    out = {r.id: [] for r in reqs}
    second = None
    killed_at = None
    answered_before = 0
    try:
        for step in range(3000):
            decoded = sum(c[2] for c in client.calls)
            if killed_at is None and decoded >= 6:
                first.stop()  # killed mid-stream: plain decoding while it is gone
                killed_at = step
            if killed_at is not None and second is None and step >= killed_at + 3:
                second = _server(head, port)
                second.start()
                client.wait_ready(10)
                answered_before = len(client.answered)
                engine.drafter._retry_at = 0.0  # retry now rather than after RETRY_S
            engine.step()
            for rid, s in streams.items():
                while (d := s.get(timeout=0)) is not None:
                    out[rid].extend(d.token_ids)
            if not engine.has_work():
                break
        assert out == ref
        assert killed_at is not None and second is not None
        # The restarted drafter took full histories (features recomputed by the target)
        # and drafted again.
        after = [u for call in client.answered[answered_before:] for u in call]
        assert any(len(u.new_tokens) == u.total_len for u in after)  # from position 0
        assert any(not u.ingest for u in after)
    finally:
        client.close()
        if second is not None:
            second.stop()
    decoding = [c for c in client.calls if c[2]]
    per_iter = np.mean([c[0] for c in decoding])
    per_msg = np.mean([c[1] for c in decoding])
    per_req = np.mean([c[0] / c[2] for c in decoding])
    # A measurement, not an assertion: in the test log (pytest -rP or --log-level INFO),
    # never in pytest's progress line.
    logging.getLogger(__name__).info(
        "EAGLE wire (F=%d, H=576, fp16): %.0f hidden bytes per decoding iteration (%.0f per "
        "request), %.0f bytes per SpeculateRequest; %d decoding calls",
        len(LAYERS),
        per_iter,
        per_req,
        per_msg,
        len(decoding),
    )
