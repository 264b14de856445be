"""The verifier service as a real process on loopback (tiny random target with an
in-process tiny drafter): outputs equal the target's own greedy output, the stream
protocol holds, bad input is INVALID_ARGUMENT, and every way a request can end early
(cancel, Abort, timeout) frees its state, as `Stats` shows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from adaserve.request import FINISH_REASONS, TokenDelta
from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from services.common.convert import finish_reason_from_pb, finish_reason_to_pb
from tests._serving import greedy_reference, make_served_model, start_verifier

pytestmark = pytest.mark.slow  # a model-serving process per module


def test_finish_reasons_cross_the_wire_both_ways() -> None:
    """One list of reasons (adaserve.request), one wire mapping (convert.py), which the
    verifier and the gateway both use."""
    for reason in (None, *FINISH_REASONS):
        assert finish_reason_from_pb(finish_reason_to_pb(reason)) == reason
    assert finish_reason_to_pb(None) == vpb.FINISH_REASON_UNSPECIFIED
    assert finish_reason_to_pb("length") == vpb.FINISH_REASON_LENGTH
    assert finish_reason_from_pb(99) == "error"  # a reason from a newer server
    with pytest.raises(ValueError, match="finish_reason"):
        TokenDelta((), "", "done", 1, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("served")
    return make_served_model(root / "target", seed=0), make_served_model(root / "drafter", seed=1)


@pytest.fixture(scope="module")
def stub(
    models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[vgrpc.VerifierStub]:
    target, drafter = models
    proc, addr = start_verifier(tmp_path_factory.mktemp("verifier"), target, drafter)
    try:
        with grpc.insecure_channel(addr) as channel:
            yield vgrpc.VerifierStub(channel)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def tokenizer(models: tuple[Path, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models[0])


def _request(rid: str, max_tokens: int = 24, **kw: object) -> vpb.GenerateRequest:
    sampling = vpb.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=bool(kw.pop("ignore_eos", False))
    )
    req = vpb.GenerateRequest(request_id=rid, sampling=sampling, **kw)
    if req.WhichOneof("prompt") is None:
        req.token_ids.ids.extend([40, 41, 42, 43, 44, 45])
    return req


def _run(stub: vgrpc.VerifierStub, req: vpb.GenerateRequest) -> list[vpb.GenerateChunk]:
    return list(stub.Generate(req, timeout=60))


def _tokens(chunks: list[vpb.GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _wait_idle(stub: vgrpc.VerifierStub, timeout: float = 10.0) -> vpb.VerifierStatsResponse:
    deadline = time.monotonic() + timeout
    while True:
        stats = stub.Stats(vpb.VerifierStatsRequest())
        if (stats.num_requests == 0 and stats.kv_usage == 0.0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_info(stub: vgrpc.VerifierStub) -> None:
    info = stub.Info(vpb.InfoRequest())
    assert info.served_model_name == "tiny"
    assert info.max_model_len == 512
    assert info.speculative
    assert info.slo_classes["chat"] == 50.0
    assert info.slo_classes["coding"] == pytest.approx(1.2 * info.baseline_tpot_ms)
    assert info.default_slo_class == "chat"
    assert list(info.speculation_methods) == ["auto", "model", "ngram", "none"]


@pytest.mark.parametrize(
    "method",
    [
        vpb.SPECULATION_METHOD_AUTO,
        vpb.SPECULATION_METHOD_MODEL,
        vpb.SPECULATION_METHOD_NGRAM,
        vpb.SPECULATION_METHOD_NONE,
    ],
)
def test_every_speculation_method_is_the_targets_greedy_output(stub, models, method) -> None:
    # A prompt that repeats itself: the n-gram drafter has matches to draft from.
    ids = [40, 41, 42, 43, 44, 45] * 4
    req = _request(f"method-{method}", max_tokens=40, token_ids=vpb.TokenIds(ids=ids))
    req.speculation_method = method
    assert _tokens(_run(stub, req)[1:]) == greedy_reference(models[0], ids, 40)


def test_token_ids_greedy_equals_target(stub: vgrpc.VerifierStub, models) -> None:
    req = _request("ids-1", max_tokens=40)
    chunks = _run(stub, req)
    header, body = chunks[0], chunks[1:]
    assert not header.token_ids and header.num_prompt_tokens == 6
    assert header.tpot_slo_ms == 50.0 and header.slo_class == "chat"
    assert all(c.finish_reason == vpb.FINISH_REASON_UNSPECIFIED for c in body[:-1])
    assert body[-1].finish_reason in (vpb.FINISH_REASON_STOP, vpb.FINISH_REASON_LENGTH)
    assert body[0].HasField("ttft_ms")
    expected = greedy_reference(models[0], list(req.token_ids.ids), 40)
    assert _tokens(body) == expected
    assert body[-1].num_generated == len(expected)
    elapsed = [c.server_elapsed_ms for c in chunks]
    assert elapsed == sorted(elapsed)


def test_text_and_chat_prompts_use_the_target_tokenizer(stub, models, tokenizer) -> None:
    text = "The quick brown fox"
    chunks = _run(stub, _request("text-1", text=text))
    ids = tokenizer.encode(text)
    assert chunks[0].num_prompt_tokens == len(ids)
    expected = greedy_reference(models[0], ids, 24)
    assert _tokens(chunks) == expected
    assert "".join(c.text for c in chunks) == tokenizer.decode(expected, skip_special_tokens=True)

    chat = vpb.ChatMessages(add_generation_prompt=True)
    chat.messages.add(role="user", content="hello")
    chunks = _run(stub, _request("chat-1", chat=chat))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert chunks[0].num_prompt_tokens == len(ids)
    assert _tokens(chunks) == greedy_reference(models[0], ids, 24)


def test_slo_resolution(stub: vgrpc.VerifierStub) -> None:
    assert _run(stub, _request("slo-1", max_tokens=2, slo_class="summarize"))[0].tpot_slo_ms == 150
    head = _run(stub, _request("slo-2", max_tokens=2, tpot_slo_ms=33.0))[0]
    assert (head.tpot_slo_ms, head.slo_class) == (33.0, "custom")


@pytest.mark.parametrize(
    "req,fragment",
    [
        (_request("bad-1", token_ids=vpb.TokenIds(ids=[1] * 600)), "context length"),
        (_request("bad-2", max_tokens=510, token_ids=vpb.TokenIds(ids=[1] * 10)), "context"),
        (_request("bad-3", token_ids=vpb.TokenIds(ids=[])), "empty"),
        (_request("bad-4", text=""), "empty"),
        (_request("bad-5", token_ids=vpb.TokenIds(ids=[5, 10_000])), "token ids"),
        (_request("bad-6", slo_class="gold"), "slo_class"),
        (_request("bad-7", max_tokens=-2), "max_tokens"),
        (_request("bad-8", token_ids=vpb.TokenIds(ids=[-1, 3])), "token"),
        (_request("bad-9", speculation_method=9), "speculation.method"),  # type: ignore[arg-type]
        (_request("bad-10", speculation_method=vpb.SPECULATION_METHOD_EAGLE), "not available"),
    ],
)
def test_bad_input_is_invalid_argument(stub, req: vpb.GenerateRequest, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _run(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()
    assert _wait_idle(stub).num_requests == 0


def test_cancel_mid_stream_frees_state(stub: vgrpc.VerifierStub) -> None:
    call = stub.Generate(_request("cancel-1", max_tokens=400, ignore_eos=True), timeout=60)
    seen = 0
    for chunk in call:
        seen += len(chunk.token_ids)
        if seen >= 5:
            break
    busy = stub.Stats(vpb.VerifierStatsRequest())
    assert busy.num_requests == 1 and busy.kv_usage > 0
    call.cancel()
    stats = _wait_idle(stub)
    assert (stats.num_requests, stats.running, stats.kv_usage) == (0, 0, 0.0)


def test_abort_rpc_ends_the_stream(stub: vgrpc.VerifierStub) -> None:
    call = stub.Generate(_request("abort-1", max_tokens=400, ignore_eos=True), timeout=60)
    next(call)  # admitted
    stub.Abort(vpb.AbortRequest(request_id="abort-1"))
    stub.Abort(vpb.AbortRequest(request_id="never-existed"))  # ignored
    last = list(call)[-1]
    assert last.finish_reason == vpb.FINISH_REASON_ABORT
    assert _wait_idle(stub).num_requests == 0


def test_timeout_finishes_the_request(stub: vgrpc.VerifierStub) -> None:
    # A fast host may finish all 480 tokens inside a timeout: it shrinks until one expires.
    for i, timeout_s in enumerate((0.3, 0.1, 0.03, 0.01)):
        req = _request(f"slow-{i}", max_tokens=480, ignore_eos=True, timeout_s=timeout_s)
        chunks = _run(stub, req)
        if chunks[-1].finish_reason != vpb.FINISH_REASON_LENGTH:
            break
    assert chunks[-1].finish_reason == vpb.FINISH_REASON_TIMEOUT
    assert sum(len(c.token_ids) for c in chunks) < 480
    assert _wait_idle(stub).num_requests == 0


def test_engine_full_is_resource_exhausted(stub: vgrpc.VerifierStub) -> None:
    # max_running 8 + max_queue 8 (tests/_serving.TEST_CONFIG): the rest are refused.
    calls = [
        stub.Generate(_request(f"full-{i}", max_tokens=480, ignore_eos=True), timeout=60)
        for i in range(24)
    ]
    codes = []
    for call in calls:
        try:
            next(call)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert dict(err.trailing_metadata())["retry-after"] == "1"
    for call in calls:
        call.cancel()
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert codes.count(grpc.StatusCode.OK) >= 8
    assert _wait_idle(stub).num_requests == 0
