"""Failure isolation: a failure that concerns one request ends that request alone.

The engine runs the real tiny target and a real drafter (the target drafting for
itself, so trees are deep and accepted); faults are injected by patching one method
of the real engine or target to raise for one request id. The survivors' output must
stay the target's own greedy output (Hugging Face reference), every KV block must
come back, and the engine must go on serving.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from adaserve import metrics
from adaserve.engine import Engine, output
from adaserve.engine.state import Request
from adaserve.isolation import MAX_STRIKES, Quarantine
from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from services.common.server import BackgroundServer
from services.verifier.server import build_server
from tests._engine import LONG, PROMPTS, hf_greedy, make_engine, req, run_to_completion
from tests._engine import target_dir as target_dir  # the module's fixture

# ---- the quarantine's bisection (pure) ------------------------------------------------


def _bisect(ids: list[str], bad: set[str], transient: int = 0) -> tuple[list[str], int]:
    """Runs iterations as the engine does until no suspect is left: each carries the
    quarantine's head group (all requests when it is empty) and fails while it carries
    a `bad` request, or for the first `transient` iterations. Returns (ended, iterations)."""
    q, alive, ended = Quarantine(), list(ids), []
    for n in range(1, 200):
        allowed = q.allowed(alive)
        carried = [i for i in alive if allowed is None or i in allowed]
        if n <= transient or bad & set(carried):
            for culprit in q.failed(carried):
                ended.append(culprit)
                alive.remove(culprit)
        else:
            q.passed(carried)
            if allowed is None:
                return ended, n
    raise AssertionError("the bisection never ended")


@pytest.mark.parametrize("n", [1, 2, 3, 8, 13, 32])
def test_bisection_ends_the_one_bad_request_in_about_2_log2_n_iterations(n):
    ids = [f"r{i}" for i in range(n)]
    for bad in {ids[0], ids[n // 2], ids[-1]}:
        ended, iterations = _bisect(ids, {bad})
        assert ended == [bad]
        assert iterations <= 2 * max(n - 1, 1).bit_length() + 3


def test_a_transient_failure_ends_nobody_and_two_bad_requests_both_end():
    ids = [f"r{i}" for i in range(8)]
    assert _bisect(ids, set(), transient=1)[0] == []
    assert _bisect(["r0"], set(), transient=1)[0] == []  # alone, it is tried once more
    assert sorted(_bisect(ids, {"r2", "r5"})[0]) == ["r2", "r5"]


def test_requests_that_fail_only_together_end_after_max_strikes():
    """A pair that breaks the batch only together passes every bisection (each half runs
    clean) and fails the next ordinary iteration again: both end after MAX_STRIKES such
    bisections; the innocent beside them, cleared apart from them, never ends."""
    q, alive, ended, ordinary_failures = Quarantine(), ["a", "b", "c"], [], 0
    for _ in range(100):
        allowed = q.allowed(alive)
        carried = [i for i in alive if allowed is None or i in allowed]
        if {"a", "b"} <= set(carried):
            ordinary_failures += allowed is None
            out = q.failed(carried)
        else:
            out = q.passed(carried)
            if allowed is None and not out:
                break
        for i in out:
            ended.append(i)
            alive.remove(i)
    assert sorted(ended) == ["a", "b"] and ordinary_failures == MAX_STRIKES
    # One bad request among 32 (its halves never both pass) is found as before.
    assert _bisect([f"r{i}" for i in range(32)], {"r7"})[0] == ["r7"]


def test_a_culprit_found_inside_a_half_gives_its_family_no_strike():
    """An iteration carrying part of the head group (others prefilling) fails alone:
    its request is the culprit, so the group it came from did not fail only together,
    however cleanly the rest and the other half run after it, round after round."""
    q = Quarantine()
    for culprit in ("a", "e"):
        ids = [culprit, "b", "c", "d"]
        assert q.failed(ids) == []
        assert q.allowed(set(ids)) == {culprit, "b"}
        assert q.failed([culprit]) == [culprit]
        assert q.passed(["b"]) == [] and q.passed(["c", "d"]) == []
        assert q.allowed({"b", "c", "d"}) is None


def test_suspects_that_leave_are_forgotten():
    q = Quarantine()
    assert q.failed(["a", "b", "c", "d"]) == []
    assert q.allowed({"a", "b", "c", "d"}) == {"a", "b"}
    assert q.allowed({"c", "d"}) == {"c", "d"}  # a and b finished meanwhile
    q.passed(["c", "d"])
    assert q.allowed({"c", "d"}) is None and q.suspects == 0


# ---- the engine -----------------------------------------------------------------------

LENGTHS = [20, 24, 16]
BAD = "r1"


def _submit_three(engine: Engine, **bad_sampling) -> list:
    """r0 with a long prompt (its KV spans whole blocks: the prefix cache serves them
    again after a re-sync), r1 the one that fails (with `bad_sampling`), r2 beside them."""
    prompts = [LONG[0], PROMPTS[1], PROMPTS[2]]
    return [
        engine.submit(req(i, prompts[i], LENGTHS[i], 50.0, **(bad_sampling if i == 1 else {})))
        for i in range(3)
    ]


def _errors(phase: str) -> float:
    return metrics.request_errors_total.labels(phase)._value.get()


def _check_survivors_and_serve_on(engine: Engine, target_dir, res: dict) -> None:
    assert res["finish"] == {"r0": "length", "r1": "error", "r2": "length"}
    assert res["tokens"]["r0"] == hf_greedy(target_dir, LONG[0], LENGTHS[0])
    assert res["tokens"]["r2"] == hf_greedy(target_dir, PROMPTS[2], LENGTHS[2])
    assert engine.stats().tracked == 0
    assert engine.target.kv_usage() == 0.0
    engine.step()  # idle: flushes the drafter releases still queued
    assert engine.drafter is not None and engine.drafter.inner.runner.kv_usage() == 0.0
    # ... and the engine keeps serving (the fault is still armed for r1).
    again = [engine.submit(req(3, PROMPTS[3], 10, 50.0))]
    assert run_to_completion(engine, again)["tokens"]["r3"] == hf_greedy(target_dir, PROMPTS[3], 10)
    assert engine.target.kv_usage() == 0.0


def _error_message(engine: Engine, streams, monkeypatch) -> dict:
    """run_to_completion, also recording the error of each request that ends with one."""
    errors: dict[str, str | None] = {}
    for s in streams:
        put = s.put

        def recording(delta, put=put, rid=s.request_id):
            if delta.finish_reason == "error":
                errors[rid] = delta.error
            put(delta)

        monkeypatch.setattr(s, "put", recording)
    res = run_to_completion(engine, streams)
    res["errors"] = errors
    return res


@pytest.mark.parametrize("where", ["apply", "constrain", "stream"])
def test_a_failure_in_one_requests_own_work_ends_it_alone(target_dir, monkeypatch, caplog, where):
    """Its stop checks (`_apply`), its logits context (built in `_constrain`) or its
    stream raise once it has a few tokens: it ends with "error" in that iteration, the
    others go on in the same iteration (no iteration fails) and finish the target's own
    output, and no KV is left behind."""
    caplog.set_level(logging.ERROR, logger="adaserve.engine")
    engine = make_engine(target_dir, target_dir)
    streams = _submit_three(engine)
    if where == "apply":
        apply = output.apply_tokens

        def failing_apply(eng, r, *args, **kwargs):
            if r.req.id == BAD and r.num_generated >= 3:
                raise RuntimeError("stop check blew up")
            return apply(eng, r, *args, **kwargs)

        monkeypatch.setattr(output, "apply_tokens", failing_apply)
    elif where == "constrain":
        context = Request.logits_context

        def failing_context(r, masks):
            if r.req.id == BAD and r.num_generated >= 3:
                raise IndexError("grammar matcher state lost")
            return context(r, masks)

        monkeypatch.setattr(Request, "logits_context", failing_context)
    phase = "apply" if where == "stream" else where
    before = _errors(phase)
    if where == "stream":  # the client's stream callback raises on its 3rd delta
        bad = streams[1]
        put, calls = bad.put, []

        def failing_put(delta):
            calls.append(delta)
            if len(calls) >= 3:
                raise ConnectionResetError("client went away mid-write")
            put(delta)

        monkeypatch.setattr(bad, "put", failing_put)
        res = run_to_completion(engine, [streams[0], streams[2]])
        assert BAD not in engine.pool.running and calls[-1].finish_reason == "error"
        res["finish"]["r1"] = "error"
    else:
        res = _error_message(engine, streams, monkeypatch)
        assert "internal error in this request" in (res["errors"]["r1"] or "")
        assert len(res["tokens"]["r1"]) >= 3
        assert (
            res["tokens"]["r1"]
            == hf_greedy(target_dir, PROMPTS[1], LENGTHS[1])[: len(res["tokens"]["r1"])]
        )
    assert _errors(phase) == before + 1
    logged = [r.getMessage() for r in caplog.records]
    assert not any("iteration failed" in m for m in logged)
    assert sum(f"request {BAD} failed ({phase}" in m for m in logged) == 1  # logged once
    _check_survivors_and_serve_on(engine, target_dir, res)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_forward_that_fails_whenever_one_request_is_in_it_ends_that_request(
    target_dir, monkeypatch, when
):
    """The target's forward raises whenever r1's tree is in it, once r1 has decoded a few
    tokens: `before` running (nothing touched), or `after` it ran and committed every
    tree's accepted KV (the engine never saw those tokens). The quarantine bisects the
    batch and ends r1 alone; the others' KV is rebuilt from their committed tokens, so
    their output is still the target's own."""
    engine = make_engine(target_dir, target_dir)
    forward = engine.target.forward
    failed: list[list[str]] = []

    def failing_forward(items, chunks):
        ids = [it.seq_id for it in items]
        bad = BAD in ids and engine.pool.running[BAD].num_generated >= 4
        if bad and when == "before":
            failed.append(ids)
            raise RuntimeError("device-side assert: index out of range")
        result = forward(items, chunks)
        if bad:
            failed.append(ids)
            raise RuntimeError("failure after the commit")
        return result

    monkeypatch.setattr(engine.target, "forward", failing_forward)
    before = _errors("batch")
    res = _error_message(engine, _submit_three(engine), monkeypatch)
    assert "internal error in this request (batch" in (res["errors"]["r1"] or "")
    assert _errors("batch") == before + 1
    # It failed in the whole batch, then in the half holding r1, then alone: ended.
    assert failed == [["r0", "r1", "r2"], ["r0", "r1"], [BAD]]
    _check_survivors_and_serve_on(engine, target_dir, res)


def test_requests_whose_trees_fail_only_together_end_and_the_third_finishes(
    target_dir, monkeypatch
):
    """The forward raises whenever r0's and r1's trees are in it together (each runs
    clean alone). Bisection never finds a culprit, so after MAX_STRIKES bisections both
    end; r2, cleared apart from them, finishes with the target's own output."""
    engine = make_engine(target_dir, target_dir)
    forward = engine.target.forward
    failures = 0

    def failing_forward(items, chunks):
        nonlocal failures
        if {"r0", "r1"} <= {it.seq_id for it in items}:
            failures += 1
            raise RuntimeError("fails only with both")
        return forward(items, chunks)

    monkeypatch.setattr(engine.target, "forward", failing_forward)
    res = _error_message(engine, _submit_three(engine), monkeypatch)
    assert res["finish"] == {"r0": "error", "r1": "error", "r2": "length"}
    assert "internal error in this request (batch" in (res["errors"]["r0"] or "")
    assert res["tokens"]["r2"] == hf_greedy(target_dir, PROMPTS[2], LENGTHS[2])
    # Each round: the whole batch fails, then its half holding both; halves of that run.
    assert failures == 2 * MAX_STRIKES
    assert engine.target.kv_usage() == 0.0


def test_a_logits_processor_raising_inside_the_real_forward_ends_its_request(
    target_dir, monkeypatch
):
    """r1 asks for a presence penalty, and processing its rows (inside the target's
    forward, after the model ran: the trees' KV sits in scratch) raises once it has a
    few tokens. Nothing but that one call is patched: the bisection ends r1 alone."""
    import adaserve.runner_target

    engine = make_engine(target_dir, target_dir)
    process = adaserve.runner_target.process_rows_

    def failing_process(rows, parents, tokens, ctx):
        if ctx.sampling.presence_penalty and len(ctx.output) >= 3:
            raise ValueError("penalty state out of range")
        return process(rows, parents, tokens, ctx)

    monkeypatch.setattr(adaserve.runner_target, "process_rows_", failing_process)
    before = _errors("batch")
    res = _error_message(engine, _submit_three(engine, presence_penalty=0.5), monkeypatch)
    assert res["errors"]["r1"] == "internal error in this request (batch: ValueError)"
    assert len(res["tokens"]["r1"]) >= 3
    assert _errors("batch") == before + 1
    _check_survivors_and_serve_on(engine, target_dir, res)


def test_a_transient_forward_failure_ends_nobody(target_dir, monkeypatch):
    """One forward fails for no request's reason: every request is retried and finishes
    with the target's own output; none is ended."""
    engine = make_engine(target_dir, target_dir)
    forward = engine.target.forward
    calls = [0]

    def flaky_forward(items, chunks):
        calls[0] += 1
        result = forward(items, chunks)
        if calls[0] == 5:
            raise RuntimeError("transient")
        return result

    monkeypatch.setattr(engine.target, "forward", flaky_forward)
    before = sum(_errors(p) for p in ("batch", "apply", "resync"))
    streams = _submit_three(engine)
    res = run_to_completion(engine, streams)
    assert set(res["finish"].values()) == {"length"}
    prompts = [LONG[0], PROMPTS[1], PROMPTS[2]]
    for i in range(3):
        assert res["tokens"][f"r{i}"] == hf_greedy(target_dir, prompts[i], LENGTHS[i])
    assert sum(_errors(p) for p in ("batch", "apply", "resync")) == before
    assert engine.target.kv_usage() == 0.0


def test_over_grpc_the_failing_requests_stream_ends_with_an_error_frame(target_dir, monkeypatch):
    """The verifier service in process, over real gRPC: three streams at once, the
    forward failing whenever one of them decodes. That stream ends with an error frame
    (finish reason ERROR and the engine's message); the other two complete with the
    target's own output."""
    engine = make_engine(target_dir, target_dir, slo={"baseline_tpot_ms": 20.0})
    forward = engine.target.forward

    def failing_forward(items, chunks):
        if any(it.seq_id == "bad" for it in items):
            raise RuntimeError("kernel failed on this request's input")
        return forward(items, chunks)

    monkeypatch.setattr(engine.target, "forward", failing_forward)
    prompts = {"a": LONG[1], "bad": PROMPTS[1], "b": PROMPTS[4]}

    def generate(address: str, rid: str) -> list[vpb.GenerateChunk]:
        req = vpb.GenerateRequest(
            request_id=rid,
            sampling=vpb.SamplingParams(max_tokens=12, ignore_eos=True),
            tpot_slo_ms=1000.0,
        )
        req.token_ids.ids.extend(prompts[rid])
        with grpc.insecure_channel(address) as channel:
            return list(vgrpc.VerifierStub(channel).Generate(req, timeout=120))

    engine.start()
    server = BackgroundServer(lambda: build_server(engine, engine.settings, "127.0.0.1", 0))
    try:
        server.start()
        with ThreadPoolExecutor(3) as pool:
            chunks = pool.map(lambda rid: generate(server.address, rid), prompts)
            got = dict(zip(prompts, chunks, strict=True))
    finally:
        server.stop()
        engine.stop()
    last = got["bad"][-1]
    assert last.finish_reason == vpb.FINISH_REASON_ERROR
    assert "internal error in this request (batch" in last.error
    for rid in ("a", "b"):
        assert got[rid][-1].finish_reason == vpb.FINISH_REASON_LENGTH, rid
        tokens = [t for c in got[rid] for t in c.token_ids]
        assert tokens == hf_greedy(target_dir, prompts[rid], 12), rid
    assert engine.target.kv_usage() == 0.0
