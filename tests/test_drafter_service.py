"""The drafter service through a real grpc.aio server on loopback and the real client,
over a tiny random Llama: the same trees as the in-process BeamDrafter, lost state
reported (after Release and after a restart) and re-synced, INVALID_ARGUMENT for bad
input, health, reflection, and the `adaserve drafter` command line."""

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

from adaserve.drafter import DrafterStateLost, DraftUpdate
from adaserve.model.loader import load_runner
from adaserve.rpc.v1 import drafter_pb2, drafter_pb2_grpc
from adaserve.speculate import BeamDrafter
from adaserve.tree import CandidateTree
from services.common.convert import I32, packed
from services.common.options import insecure_channel
from services.common.server import BackgroundServer
from services.drafter.client import GrpcDrafter
from services.drafter.server import SERVICE_NAME, build_server

VOCAB = 256  # tests/conftest.py TINY


def new_drafter(model_dir: Path) -> BeamDrafter:
    return BeamDrafter(load_runner(model_dir, device="cpu", dtype="float32", kv_blocks=256))


@pytest.fixture
def served(tiny_llama_dir: Path) -> Iterator[tuple[BackgroundServer, GrpcDrafter]]:
    server = BackgroundServer(lambda: build_server(new_drafter(tiny_llama_dir), "127.0.0.1", 0))
    with server, GrpcDrafter(server.address, timeout_s=30.0) as client:
        yield server, client


def assert_same_trees(got: list[CandidateTree], want: list[CandidateTree]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.parents, w.parents)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


def test_speculate_matches_in_process(served, tiny_llama_dir: Path) -> None:
    _, client = served
    local = new_drafter(tiny_llama_dir)
    rng = np.random.default_rng(0)
    history = {f"r{i}": list(rng.integers(0, VOCAB, 5 + 3 * i)) for i in range(3)}
    sent = dict.fromkeys(history, 0)
    for step, (depth, width) in enumerate([(3, 2), (4, 3), (1, 1), (2, 4)]):
        updates = [
            DraftUpdate(rid, np.array(toks[sent[rid] :], np.int32), len(toks))
            for rid, toks in history.items()
        ]
        got = client.speculate(updates, depth, width)
        want = local.speculate(updates, depth, width)
        assert_same_trees(got, want)
        assert all(len(t) == 1 + depth * width for t in got), step
        assert client.last_timing is not None and client.last_timing.compute_us > 0
        # Commit a path the way the engine would: some drafted tokens, then a bonus.
        for rid, tree in zip(history, got, strict=True):
            sent[rid] = len(history[rid])
            history[rid] += [int(tree.tokens[1]), int(rng.integers(0, VOCAB))]


def test_lost_state_is_reported_then_resynced(served) -> None:
    _, client = served
    prompt = np.arange(1, 9, dtype=np.int32)
    client.speculate([DraftUpdate("a", prompt, 8), DraftUpdate("b", prompt, 8)], 2, 2)
    # Unknown id, or a length that disagrees with the drafter's count: lost, not an error.
    with pytest.raises(DrafterStateLost) as info:
        client.speculate(
            [
                DraftUpdate("a", np.array([3], np.int32), 9),
                DraftUpdate("zzz", np.array([3], np.int32), 12),
            ],
            2,
            2,
        )
    assert info.value.ids == ["zzz"]
    client.release(["b"])
    with pytest.raises(DrafterStateLost) as info:
        client.speculate([DraftUpdate("b", np.array([3], np.int32), 9)], 2, 2)
    assert info.value.ids == ["b"]
    # Re-sync with the full history, as the engine does.
    trees = client.speculate([DraftUpdate("b", np.append(prompt, 3).astype(np.int32), 9)], 2, 2)
    assert trees[0].tokens[0] == 3 and len(trees[0]) == 5


def test_restart_loses_state_and_the_same_client_recovers(tiny_llama_dir: Path) -> None:
    first = BackgroundServer(lambda: build_server(new_drafter(tiny_llama_dir), "127.0.0.1", 0))
    port = first.start()
    client = GrpcDrafter(f"127.0.0.1:{port}", timeout_s=30.0)
    try:
        prompt = np.arange(10, 20, dtype=np.int32)
        client.speculate([DraftUpdate("x", prompt, 10)], 2, 2)
        first.stop()
        with pytest.raises(ConnectionError):
            client.speculate([DraftUpdate("x", np.array([5], np.int32), 11)], 2, 2)
        second = BackgroundServer(
            lambda: build_server(new_drafter(tiny_llama_dir), "127.0.0.1", port)
        )
        with second:
            client.wait_ready(10)
            with pytest.raises(DrafterStateLost) as info:
                client.speculate([DraftUpdate("x", np.array([5], np.int32), 11)], 2, 2)
            assert info.value.ids == ["x"]
            full = np.append(prompt, 5).astype(np.int32)
            assert len(client.speculate([DraftUpdate("x", full, 11)], 2, 2)[0]) == 5
    finally:
        client.close()


def test_release_is_idempotent_and_stats_follow(served) -> None:
    _, client = served
    prompt = np.arange(1, 6, dtype=np.int32)
    client.speculate([DraftUpdate(i, prompt, 5) for i in ("p", "q")], 1, 2)
    stats = client.stats()
    assert stats.num_sequences == 2 and 0.0 < stats.kv_usage <= 1.0
    client.release(["p", "never-seen"])
    client.release(["p"])
    assert client.stats().num_sequences == 1
    client.release(["q"])
    assert client.stats().num_sequences == 0
    assert client.speculate([], 3, 2) == []


def raw_update(rid: str = "u", tokens: bytes | None = None, total_len: int = 3):
    tokens = packed([1, 2, 3], I32) if tokens is None else tokens
    return drafter_pb2.DraftUpdate(id=rid, new_tokens=tokens, total_len=total_len)


BAD = {
    "negative depth": (
        drafter_pb2.SpeculateRequest(updates=[raw_update()], depth=-1, width=2),
        "depth",
    ),
    "zero width": (drafter_pb2.SpeculateRequest(updates=[raw_update()], depth=2, width=0), "width"),
    "ragged tokens": (
        drafter_pb2.SpeculateRequest(updates=[raw_update(tokens=b"\x01" * 7)], depth=1, width=1),
        "updates[0].new_tokens",
    ),
    "more tokens than total_len": (
        drafter_pb2.SpeculateRequest(updates=[raw_update(total_len=2)], depth=1, width=1),
        "total_len",
    ),
    "zero total_len": (
        drafter_pb2.SpeculateRequest(
            updates=[raw_update(tokens=b"", total_len=0)], depth=1, width=1
        ),
        "total_len",
    ),
    "duplicate id": (
        drafter_pb2.SpeculateRequest(updates=[raw_update(), raw_update()], depth=1, width=1),
        "twice",
    ),
    "empty id": (
        drafter_pb2.SpeculateRequest(updates=[raw_update(rid="")], depth=1, width=1),
        "updates[0].id",
    ),
    "token out of vocabulary": (
        drafter_pb2.SpeculateRequest(
            updates=[raw_update(tokens=packed([1, VOCAB + 5], I32), total_len=2)], depth=1, width=1
        ),
        "token id",
    ),
    "negative token": (
        drafter_pb2.SpeculateRequest(
            updates=[raw_update(tokens=packed([-4], I32), total_len=1)], depth=1, width=1
        ),
        "token id",
    ),
    "width above vocabulary": (
        drafter_pb2.SpeculateRequest(updates=[raw_update()], depth=2, width=VOCAB + 1),
        "width",
    ),
    "stop_prob of one": (
        drafter_pb2.SpeculateRequest(updates=[raw_update()], depth=3, width=2, stop_prob=1.0),
        "stop_prob",
    ),
    "negative stop_prob": (
        drafter_pb2.SpeculateRequest(updates=[raw_update()], depth=3, width=2, stop_prob=-0.1),
        "stop_prob",
    ),
    "NaN stop_prob": (
        drafter_pb2.SpeculateRequest(
            updates=[raw_update()], depth=3, width=2, stop_prob=float("nan")
        ),
        "stop_prob",
    ),
}


def test_malformed_speculate_is_invalid_argument(served) -> None:
    server, client = served
    with insecure_channel(server.address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for case, (msg, needle) in BAD.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.Speculate(msg, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            assert needle in info.value.details(), (case, info.value.details())
        # Nothing half-built stays behind, and the server still serves.
        assert stub.Stats(drafter_pb2.StatsRequest(), timeout=5).num_sequences == 0
    assert len(client.speculate([DraftUpdate("ok", np.array([1, 2], np.int32), 2)], 1, 1)) == 1
    with pytest.raises(ValueError, match="width"):
        client.speculate([DraftUpdate("ok2", np.array([1], np.int32), 1)], 1, 0)


def test_health_and_reflection(served) -> None:
    server, _ = served
    with insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert SERVICE_NAME in names


@pytest.mark.slow  # a fresh interpreter importing torch: ~10 s on 2 shared cores
def test_cli_serves_and_stops_on_sigterm(tiny_llama_dir: Path) -> None:
    script = Path(sys.executable).with_name("adaserve")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "adaserve.cli"]
    proc = subprocess.Popen(
        [
            *cmd,
            "drafter",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--model",
            str(tiny_llama_dir),
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), (line, proc.stderr.read())
        with GrpcDrafter(line.split()[-1], timeout_s=30.0) as client:
            prompt = np.arange(3, 10, dtype=np.int32)
            trees = client.speculate([DraftUpdate("c", prompt, 7)], 2, 3)
            assert len(trees[0]) == 7 and trees[0].tokens[0] == 9
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_prob_crosses_the_wire(served, tiny_llama_dir: Path) -> None:
    """The service cuts trees as the in-process drafter does (bad values: BAD above)."""
    _, client = served
    local = new_drafter(tiny_llama_dir)
    rng = np.random.default_rng(1)
    history = {f"s{i}": list(rng.integers(0, VOCAB, 6 + 2 * i)) for i in range(3)}
    updates = [DraftUpdate(k, np.array(v, np.int32), len(v)) for k, v in history.items()]
    got = client.speculate(updates, 5, 2, 1e-3)
    assert_same_trees(got, local.speculate(updates, 5, 2, 1e-3))
    assert min(len(t) for t in got) < 1 + 5 * 2  # cut short
