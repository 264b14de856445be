"""Faults with real processes on loopback: scheduler, drafter, two verifier units and a
gateway, each its own process (tiny random target with its character tokenizer; the
drafter is the target itself, so speculation accepts long paths and any slip in
re-syncing draft state would show in the output).

Unit A uses the drafter and scheduler services; unit B selects in-process and uses a
second drafter service made slow by fault injection (3 s per Speculate, far past its
200 ms speculation timeout). What each test kills, it restarts, so the tests also run
one by one (`-k`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from adaserve.rpc.v1 import verifier_pb2 as vpb
from adaserve.rpc.v1 import verifier_pb2_grpc as vgrpc
from services.common.faults import DRAFTER_DELAY_ENV
from tests._faults import (
    LONG,
    Service,
    SSEClient,
    StreamRecorder,
    drafter_stats,
    greedy_reference_ignore_eos,
    greedy_request,
    metric,
    verifier_stats,
    wait_until,
)
from tests._serving import free_port, make_served_model

pytestmark = pytest.mark.slow  # six serving processes

UNIT_CONFIG = """\
engine:
  kv_memory_gb: 0.05
  max_running: 8
  max_queue: 16
  speculation_timeout_ms: 200
  scheduler_timeout_ms: 200
scheduler:
  # every Select to the service, so that killing it shows (auto would select here,
  # where that is faster, and meet the dead service only on a probe)
  remote_select: always
slo:
  baseline_tpot_ms: 20.0
"""
GATEWAY_CONFIG = "gateway:\n  health_interval_s: 0.5\n"
PROMPTS = [[(7 * i + 3 * k) % 90 + 4 for k in range(6 + i)] for i in range(8)]


@dataclass
class Deployment:
    target: Path
    tokenizer: object
    scheduler: Service
    drafter: Service
    unit_a: Service
    unit_b: Service
    gateway: Service
    metrics_a: str
    metrics_b: str
    _refs: dict[int, list[int]] = field(default_factory=dict)

    def reference(self, prompt_index: int, n: int = LONG) -> list[int]:
        """The target's greedy output for PROMPTS[i] (greedy prefixes are prefixes)."""
        if prompt_index not in self._refs:
            self._refs[prompt_index] = greedy_reference_ignore_eos(
                self.target, PROMPTS[prompt_index], LONG
            )
        return self._refs[prompt_index][:n]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stub_a(self) -> vgrpc.VerifierStub:
        return vgrpc.VerifierStub(grpc.insecure_channel(self.unit_a.address))

    def wait_idle(self, *units: Service) -> None:
        for unit in units or (self.unit_a, self.unit_b):
            wait_until(
                f"{unit.name} idle",
                lambda u=unit: (
                    (s := verifier_stats(u.address)).num_requests == 0 and s.kv_usage == 0.0
                ),
            )

    def both_units_ready(self) -> bool:
        units = httpx.get(f"{self.gateway.url}/ready", timeout=2).json().get("units", [])
        return len(units) == 2 and all(u["healthy"] for u in units)


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("faults")
    target = make_served_model(root / "target", seed=0)
    cfg, gw_cfg = root / "unit.yaml", root / "gateway.yaml"
    cfg.write_text(UNIT_CONFIG)
    gw_cfg.write_text(GATEWAY_CONFIG)
    common = ["--target", str(target), "--served-model-name", "tiny", "--config", str(cfg)]
    mport = free_port()
    scheduler = Service("scheduler", ["scheduler", "--config", str(cfg)], root)
    drafter = Service("drafter", ["drafter", "--model", str(target), "--config", str(cfg)], root)
    unit_a = Service(
        "unit-a",
        [
            *("verifier", *common, "--drafter-address", drafter.address),
            *("--scheduler-address", scheduler.address, "--metrics-port", str(mport)),
        ],
        root,
    )
    slow_drafter = Service(
        "slow-drafter",
        ["drafter", "--model", str(target), "--config", str(cfg)],
        root,
        env={DRAFTER_DELAY_ENV: "3000"},
    )
    mport_b = free_port()
    unit_b = Service(
        "unit-b",
        [
            *("verifier", *common, "--drafter-address", slow_drafter.address),
            *("--metrics-port", str(mport_b)),
        ],
        root,
    )
    gateway = Service(
        "gateway",
        [
            *("gateway", "--grpc-port", "-1", "--config", str(gw_cfg)),
            *("--verifier", unit_a.address, "--verifier", unit_b.address),
        ],
        root,
        http=True,
    )
    services = [scheduler, drafter, slow_drafter, unit_a, unit_b, gateway]
    try:
        for svc in services:
            svc.launch()
        d = Deployment(
            target,
            AutoTokenizer.from_pretrained(target),
            scheduler,
            drafter,
            unit_a,
            unit_b,
            gateway,
            f"http://127.0.0.1:{mport}/metrics",
            f"http://127.0.0.1:{mport_b}/metrics",
        )
        for i in range(6):  # while the services load
            d.reference(i)
        for svc in services:
            svc.wait_ready()
        wait_until("both units behind the gateway", d.both_units_ready)
        yield d
    finally:
        for svc in services:  # graceful shutdown is not under test here
            svc.kill()


# ---- deadlines ------------------------------------------------------------------------


def test_request_timeout_cancels_everywhere(dep: Deployment) -> None:
    """`timeout` in the body travels gateway -> verifier (timeout_s); the engine ends the
    request, frees its KV and releases its draft state on the drafter service. The
    requests ask for the draft model, so the drafter holds state for them. A fast host
    can finish a request inside a timeout, so the timeout halves until both expire."""
    held_state = False
    for timeout in (0.8, 0.4, 0.2, 0.1, 0.05):
        bodies = [
            {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": LONG, "temperature": 0}
            | {"ignore_eos": True, "timeout": timeout, "speculation": {"method": "model"}}
            for i in range(2)
        ]
        results: list[httpx.Response] = []

        def post(body: dict, out: list[httpx.Response] = results) -> None:
            out.append(httpx.post(f"{dep.gateway.url}/v1/completions", json=body, timeout=30))

        threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
        for t in threads:
            t.start()
        # Both units serve one each (least outstanding); unit A's draft state is remote.
        while any(t.is_alive() for t in threads):
            held_state = held_state or drafter_stats(dep.drafter.address).num_sequences > 0
            time.sleep(0.01)
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 408}, [r.text for r in results]
        if codes == [408, 408]:
            break
    # No OpenAI client knows a "timeout" finish_reason: it is a 408 in OpenAI's shape.
    assert codes == [408, 408]
    assert all(r.json()["error"]["code"] == "timeout" for r in results)
    assert held_state, "the drafter never held state for the requests"
    dep.wait_idle()
    wait_until(
        "draft state released", lambda: drafter_stats(dep.drafter.address).num_sequences == 0
    )


def test_grpc_deadline_cancels_everywhere(dep: Deployment) -> None:
    """A caller's gRPC deadline (no timeout_s) cancels the call; the verifier aborts the
    request and the drafter's state for it is released. The request asks for the draft
    model, so the drafter holds state for it. A fast host can finish the whole request
    inside a deadline (it did in CI at 1 s), so the deadline halves until one expires
    mid-stream; each try is checked for a clean end either way."""
    held_state = False
    for i, deadline_s in enumerate((1.0, 0.5, 0.25, 0.12, 0.06)):
        req = greedy_request(
            f"deadline-{i}", PROMPTS[2], LONG, speculation_method=vpb.SPECULATION_METHOD_MODEL
        )
        rec = StreamRecorder(dep.stub_a(), req, timeout=deadline_s)
        while not rec.done:
            held_state = held_state or drafter_stats(dep.drafter.address).num_sequences > 0
            time.sleep(0.01)
        if rec.error is not None:
            break
        assert rec.finish == vpb.FINISH_REASON_LENGTH and len(rec.tokens) == LONG
    assert rec.error is not None and rec.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert held_state, "the drafter never held state for the request"
    dep.wait_idle(dep.unit_a)
    wait_until(
        "draft state released", lambda: drafter_stats(dep.drafter.address).num_sequences == 0
    )


def test_unattainable_slo_is_served_best_effort_and_flagged(dep: Deployment) -> None:
    """An SLO below the deployment's floor (the best TPOT one request alone can expect:
    no forward through this stack takes under 0.45 ms) is served, not refused (policy
    `best_effort`, the default), and flagged in the response, with the floor and the
    reason, and in the gateway's metrics."""
    name = "adaserve_gateway_best_effort_requests_total"
    before = metric(f"{dep.gateway.url}/metrics", name, 'slo_class="custom"')
    r = httpx.post(
        f"{dep.gateway.url}/v1/completions",
        json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
        | {"ignore_eos": True, "tpot_slo_ms": 0.05},
        timeout=60,
    )
    assert r.status_code == 200
    body = r.json()
    slo = body["slo"]
    assert {k: slo[k] for k in ("tpot_slo_ms", "slo_class", "best_effort")} == {
        "tpot_slo_ms": 0.05,
        "slo_class": "custom",
        "best_effort": True,
    }
    assert slo["slo_floor_ms"] > 0.05 and "floor" in slo["reason"]
    assert r.headers["x-slo-best-effort"] == "true"
    assert body["choices"][0]["text"] == dep.text(dep.reference(1, 12))
    assert metric(f"{dep.gateway.url}/metrics", name, 'slo_class="custom"') == before + 1


# ---- the scheduler ---------------------------------------------------------------------


def test_scheduler_killed(dep: Deployment) -> None:
    """Selection falls back in-process (no failed request, same output) and returns to
    the service once it is back."""
    stub = dep.stub_a()
    fallbacks = 'component="scheduler"'
    recs = [StreamRecorder(stub, greedy_request(f"sched-{i}", PROMPTS[i], LONG)) for i in range(4)]
    for r in recs:
        r.wait_tokens(10)
    dep.scheduler.kill()
    wait_until(
        "scheduler unhealthy", lambda: not verifier_stats(dep.unit_a.address).scheduler_healthy
    )
    assert metric(dep.metrics_a, "adaserve_fallbacks_total", fallbacks) > 0
    dep.scheduler.start()
    wait_until("scheduler healthy", lambda: verifier_stats(dep.unit_a.address).scheduler_healthy)
    for i, r in enumerate(recs):
        r.join()
        assert r.error is None and r.finish == vpb.FINISH_REASON_LENGTH
        assert r.tokens == dep.reference(i)
    # Back on the service: a new request adds no fallback.
    before = metric(dep.metrics_a, "adaserve_fallbacks_total", fallbacks)
    print(f"scheduler killed: 4 x {LONG} tokens exact, scheduler fallbacks {before:.0f}")
    rec = StreamRecorder(stub, greedy_request("sched-after", PROMPTS[5], 60)).join()
    assert rec.tokens == dep.reference(5, 60)
    assert metric(dep.metrics_a, "adaserve_fallbacks_total", fallbacks) == before


# ---- the drafter -----------------------------------------------------------------------


# One request per speculation method (two on auto, the default): killing the model
# drafter must not change any output, whichever drafters a request's trees came from.
KILL_METHODS = [
    vpb.SPECULATION_METHOD_AUTO,
    vpb.SPECULATION_METHOD_MODEL,
    vpb.SPECULATION_METHOD_NGRAM,
    vpb.SPECULATION_METHOD_UNSPECIFIED,
]


def test_drafter_killed_mid_stream(dep: Deployment) -> None:
    """Plain decoding while the drafter is gone (no failed request, output identical to
    the target's greedy output), except for the n-gram drafter in the verifier, which
    goes on drafting; after the model drafter restarts, the requests in flight re-sync
    their draft state from their full history and speculation resumes. The requests
    ask for every speculation method."""
    stub = dep.stub_a()
    resyncs = metric(dep.metrics_a, "adaserve_drafter_resyncs_total")
    drafted = metric(dep.metrics_a, "adaserve_spec_decode_num_draft_tokens_total")
    recs = [
        StreamRecorder(
            stub, greedy_request(f"kill-{i}", PROMPTS[i], LONG, speculation_method=method)
        )
        for i, method in enumerate(KILL_METHODS)
    ]
    for r in recs:
        r.wait_tokens(8)
    # Speculating before the kill (on a loaded machine the first iterations may fall back
    # to plain decoding while a selection call times out, so wait for the first tree).
    wait_until(
        "speculation before the kill",
        lambda: metric(dep.metrics_a, "adaserve_spec_decode_num_draft_tokens_total") > drafted,
    )
    dep.drafter.kill()
    wait_until("drafter unhealthy", lambda: not verifier_stats(dep.unit_a.address).drafter_healthy)
    seen = sum(len(r.tokens) for r in recs)
    ngram_steps = 'method="ngram"'
    before = metric(dep.metrics_a, "adaserve_spec_decode_method_steps_total", ngram_steps)
    wait_until("plain decoding", lambda: sum(len(r.tokens) for r in recs) > seen + 8)
    # The n-gram drafter runs in the verifier: its requests still get trees (once their
    # output repeats something; on a slow host 8 tokens may come before the first match).
    wait_until(
        "n-gram trees without the drafter",
        lambda: (
            metric(dep.metrics_a, "adaserve_spec_decode_method_steps_total", ngram_steps) > before
        ),
    )
    # Freeze the unit while the drafter restarts, so requests speculated by the old
    # drafter are still running when the new one (holding no state) answers.
    dep.unit_a.pause()
    try:
        dep.drafter.start()
    finally:
        dep.unit_a.resume()
    wait_until("drafter healthy", lambda: verifier_stats(dep.unit_a.address).drafter_healthy)
    held = wait_until(
        "speculation on the new drafter", lambda: drafter_stats(dep.drafter.address).num_sequences
    )
    for i, r in enumerate(recs):
        r.join()
        assert r.error is None and r.finish == vpb.FINISH_REASON_LENGTH, r.error
        assert r.tokens == dep.reference(i)
    assert held >= 1
    resynced = metric(dep.metrics_a, "adaserve_drafter_resyncs_total") - resyncs
    assert resynced > 0
    print(f"drafter killed: 4 x {LONG} tokens exact, {resynced:.0f} requests re-synced")
    wait_until(
        "draft state released", lambda: drafter_stats(dep.drafter.address).num_sequences == 0
    )


def test_slow_drafter_never_stalls_past_the_speculation_timeout(dep: Deployment) -> None:
    """Unit B's drafter takes 3 s per Speculate (fault injection): the engine waits at
    most one speculation timeout (200 ms) per retry and decodes without speculation in
    between, so tokens keep flowing and the output is unchanged."""
    stub = vgrpc.VerifierStub(grpc.insecure_channel(dep.unit_b.address))
    before = metric(dep.metrics_b, "adaserve_fallbacks_total", 'component="drafter"')
    rec = StreamRecorder(stub, greedy_request("slow-1", PROMPTS[3], 300)).join()
    assert rec.error is None and rec.tokens == dep.reference(3, 300)
    print(f"slow drafter: longest gap between chunks {rec.max_gap_s() * 1000:.0f} ms")
    assert rec.max_gap_s() < 1.0, rec.max_gap_s()  # 200 ms timeout + a plain iteration
    assert metric(dep.metrics_b, "adaserve_fallbacks_total", 'component="drafter"') > before
    assert not verifier_stats(dep.unit_b.address).drafter_healthy


# ---- serving units and the gateway -------------------------------------------------------


def test_one_of_two_units_killed(dep: Deployment) -> None:
    """The killed unit's in-flight streams end with an error frame and no [DONE] (their
    text so far is a true prefix), the other unit's complete; new requests go to the
    survivor; the unit is re-admitted once it is healthy again."""
    clients = [SSEClient(dep.gateway.url, PROMPTS[i]) for i in range(6)]
    wait_until("streams flowing", lambda: all(len(c.frames) >= 3 for c in clients), timeout=60)
    on_b = verifier_stats(dep.unit_b.address).running
    assert on_b >= 1
    dep.unit_b.kill()
    for c in clients:
        c.join()
    failed = [c for c in clients if not c.completed]
    print(f"unit killed: {on_b} of 6 streams on it ended with an error frame, rest complete")
    assert len(failed) == on_b
    for i, c in enumerate(clients):
        assert c.status == 200 and c.transport_error is None
        ref = dep.text(dep.reference(i))
        if c.completed:
            assert c.text() == ref
        else:
            assert c.error()["type"] == "service_unavailable_error"
            assert ref.startswith(c.text()) and len(c.text()) < len(ref)
    # Everything new lands on the survivor.
    for i in range(4):
        r = httpx.post(
            f"{dep.gateway.url}/v1/completions",
            json={"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 20, "temperature": 0}
            | {"ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == dep.text(dep.reference(i, 20))
    t0 = time.monotonic()
    dep.unit_b.start()
    serving = time.monotonic()
    wait_until("unit B re-admitted", dep.both_units_ready)
    print(
        f"unit restarted in {serving - t0:.1f} s, re-admitted "
        f"{time.monotonic() - serving:.2f} s after it served"
    )
    before = verifier_stats(dep.unit_b.address).iterations
    clients = [SSEClient(dep.gateway.url, PROMPTS[i], 40) for i in range(4)]
    assert all(c.join().completed for c in clients)
    assert verifier_stats(dep.unit_b.address).iterations > before


def test_gateway_restarted(dep: Deployment) -> None:
    """Clients of a gateway that dies see a connection error (never [DONE], and what
    they got is a true prefix); the units drop the orphaned requests; a new gateway on
    the same port serves as soon as it answers."""
    clients = [SSEClient(dep.gateway.url, PROMPTS[i]) for i in range(4)]
    wait_until("streams flowing", lambda: all(len(c.frames) >= 3 for c in clients), timeout=60)
    dep.gateway.kill()
    interrupted = 0
    for i, c in enumerate(clients):
        c.join()
        ref = dep.text(dep.reference(i))
        if c.completed:  # a fast stream can finish between the check above and the kill
            assert c.text() == ref and c.transport_error is None
            continue
        interrupted += 1
        assert c.transport_error is not None
        assert ref.startswith(c.text()) and len(c.text()) < len(ref)
    assert interrupted  # the kill landed mid-stream
    dep.wait_idle()
    t0 = time.monotonic()
    dep.gateway.launch()
    dep.gateway.wait_ready()
    r = httpx.post(
        f"{dep.gateway.url}/v1/completions",
        json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0}
        | {"ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == dep.text(dep.reference(0, 10))
    print(f"new gateway served its first request {time.monotonic() - t0:.2f} s after launch")
