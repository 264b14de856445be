"""`adaserve up` as a user runs it: every service a real process on loopback, healthy
before the URLs are printed, and all of them gone after Ctrl-C or SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests._serving import REPO, Proc, free_port, make_served_model
from tests._up import launch_up, wait_for_line

pytestmark = pytest.mark.slow  # several model-serving processes


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("up-models")
    return make_served_model(root / "target", seed=0), make_served_model(root / "drafter", seed=1)


def _json_lines(path: Path) -> list[dict]:
    """Every line of a service's log is one JSON object (one format for all)."""
    lines = path.read_text().splitlines()
    assert lines, path
    return [json.loads(line) for line in lines]


def _child_pids(text: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r"started (\S+)\s+pid (\d+)", text)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _shutdown(proc: Proc, pids: dict[str, int], sig: int) -> None:
    os.kill(proc.p.pid, sig)  # the launcher only, as a terminal Ctrl-C would
    assert proc.p.wait(60) == 0, proc.log()
    proc.stop()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids.values()), pids
    assert "adaserve up: stopped" in proc.log_path.read_text()


def test_all_in_one(models: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = models
    metrics_port = free_port()
    proc, port = launch_up(
        tmp_path,
        "--all-in-one",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        metrics_port=metrics_port,
    )
    try:
        text = wait_for_line(proc, r"Press Ctrl-C")
        # The baseline (20 ms in the test config) and what each class came to.
        assert re.search(
            r"SLOs\s+baseline TPOT 20\.0 ms; SLO classes coding 24\.0 ms, "
            r"chat 50\.0 ms \(default\), summarize 150\.0 ms; floor \d+\.\d ms",
            text,
        ), text
        assert f"http://127.0.0.1:{port}/v1" in text
        pids = _child_pids(text)
        assert set(pids) == {"verifier-0", "gateway"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        out = client.completions.create(
            model="target",
            prompt="hi",
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == 5
        engine_metrics = re.search(r"metrics\s+(\S+)\s+\(verifier-0: engine\)", text)
        assert engine_metrics, text
        assert engine_metrics[1] == f"http://127.0.0.1:{metrics_port}/metrics"
        assert "adaserve_iterations_total" in httpx.get(engine_metrics[1], timeout=10).text
        verifier_log = _json_lines(tmp_path / "logs" / "verifier-0.log")
        (slos,) = [r for r in verifier_log if "slo_classes_ms" in r]
        assert slos["baseline_tpot_ms"] == 20.0 and slos["slo_classes_ms"]["coding"] == 24.0
        gateway_log = _json_lines(tmp_path / "logs" / "gateway.log")
        assert any(r.get("baseline_tpot_ms") == 20.0 for r in gateway_log)
        _shutdown(proc, pids, signal.SIGINT)
    finally:
        proc.stop(signal.SIGKILL)


def test_services_die_with_a_killed_launcher(models: tuple[Path, Path], tmp_path: Path) -> None:
    """`adaserve up` killed outright (SIGKILL: no chance to stop its services) takes
    them with it instead of leaving them serving, ports held, as orphans."""
    target, drafter = models
    proc, _ = launch_up(tmp_path, "--target", str(target), "--drafter", str(drafter))
    pids: dict[str, int] = {}
    try:
        pids = _child_pids(wait_for_line(proc, r"Press Ctrl-C"))
        assert set(pids) == {"scheduler", "drafter-0", "verifier-0", "gateway"}
        os.kill(proc.p.pid, signal.SIGKILL)  # the launcher alone, not its group
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(p) for p in pids.values()), pids
    finally:
        proc.stop(signal.SIGKILL)
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_separate_processes_two_units(models: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = models
    has_drafter_service = (REPO / "services" / "drafter" / "__main__.py").is_file()
    args = [
        "--target",
        str(target),
        "--verifier-units",
        "2",
        "--drafter",
        str(drafter) if has_drafter_service else "none",
    ]
    proc, port = launch_up(tmp_path, *args)
    try:
        text = wait_for_line(proc, r"Press Ctrl-C")
        pids = _child_pids(text)
        expected = {"scheduler", "verifier-0", "verifier-1", "gateway"}
        if has_drafter_service:
            expected |= {"drafter-0", "drafter-1"}
        assert set(pids) == expected
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for _ in range(2):
            out = client.chat.completions.create(
                model="target",
                messages=[{"role": "user", "content": "hey"}],
                max_tokens=4,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert out.usage.completion_tokens == 4
        # One log format for every service, the drafter and scheduler included.
        for name in expected:
            _json_lines(tmp_path / "logs" / f"{name}.log")
        assert len(re.findall(r"SLOs \(127\.0\.0\.1:\d+\) baseline TPOT 20\.0 ms", text)) == 2
        _shutdown(proc, pids, signal.SIGTERM)
    finally:
        proc.stop(signal.SIGKILL)


def test_startup_failure_stops_everything(tmp_path: Path) -> None:
    proc, _ = launch_up(
        tmp_path, "--all-in-one", "--target", str(tmp_path / "no-such-model"), "--drafter", "none"
    )
    try:
        code = proc.p.wait(120)
        text = proc.log_path.read_text()
        assert code == 1, text
        assert "verifier-0 exited" in text and "does not exist" in text
        assert all(_gone(p) for p in _child_pids(text).values())
    finally:
        proc.stop(signal.SIGKILL)


def test_bad_arguments() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "adaserve.cli", "up", "--all-in-one", "--verifier-units", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--all-in-one" in r.stderr


def test_service_env_bounds_openmp_spinning_unless_told_otherwise() -> None:
    from adaserve.commands.launcher import service_env

    env = service_env({"PATH": "/bin"})
    assert env["GOMP_SPINCOUNT"] == "30000" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"] == "/bin" and "OMP_WAIT_POLICY" not in env
    shared = service_env({"PATH": "/bin"}, shared_cpu=True)
    assert shared["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in shared
    passive = service_env({"OMP_WAIT_POLICY": "PASSIVE"})
    assert passive["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in passive
    assert service_env({"GOMP_SPINCOUNT": "0"})["GOMP_SPINCOUNT"] == "0"


def test_plan_sleeps_openmp_threads_only_where_torch_processes_compute_at_once(tmp_path) -> None:
    import argparse

    from adaserve.commands.up import add_arguments, plan

    def shared(*argv: str) -> set[bool]:
        p = argparse.ArgumentParser()
        add_arguments(p)
        return {s.shared_cpu for s in plan(p.parse_args(list(argv)), tmp_path)}

    assert shared("--all-in-one") == {False}
    assert shared("--drafter", "none") == {False}
    # A drafter process and its verifier take turns (draft, then verify): both spin.
    assert shared("--drafter", "embedded") == {False}
    assert shared("--drafter", "embedded", "--verifier-units", "2") == {True}
    assert shared("--tp", "2", "--all-in-one") == {True}
    assert shared("--drafter", "none", "--verifier-units", "2") == {True}
    # With a drafter process, each verifier starts once the drafter has loaded: it
    # times the hardware at startup.
    p = argparse.ArgumentParser()
    add_arguments(p)
    services = plan(p.parse_args(["--drafter", "embedded"]), tmp_path)
    assert [s.name for s in services if s.settle_first] == ["verifier-0", "gateway"]
    aio = plan(p.parse_args(["--all-in-one"]), tmp_path)
    assert [s.name for s in aio if s.settle_first] == ["gateway"]


def test_taken_ports_are_reported_before_anything_loads(tmp_path: Path) -> None:
    """A port clash names the port and the flag, in a second: `up` checks before it
    starts a service, the verifier before it loads its model (here a model that does not
    exist, so a late check would have said that instead)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        runs = {
            "up --port": ["up", "--port", str(port), "--all-in-one"],
            "up --metrics-port": ["up", "--port", str(free_port()), "--metrics-port", str(port)],
            "verifier --port": ["verifier", "--port", str(port), "--target", "/nope"],
            "verifier --metrics-port": [
                *("verifier", "--port", str(free_port()), "--metrics-port", str(port)),
                *("--target", "/nope"),
            ],
            "drafter --port": ["drafter", "--port", str(port), "--model", "/nope"],
            "gateway --port": ["gateway", "--port", str(port), "--grpc-port", "-1"],
        }
        for name, argv in runs.items():
            flag = name.split()[1]
            t0 = time.monotonic()
            r = subprocess.run(
                [sys.executable, "-m", "adaserve.cli", *argv, "--log-dir", str(tmp_path)]
                if argv[0] == "up"
                else [sys.executable, "-m", "adaserve.cli", *argv, "--host", "127.0.0.1"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 2, (name, r.stdout, r.stderr)
            assert f"port {port} on 127.0.0.1 is already in use" in r.stderr, (name, r.stderr)
            assert f"{flag} N" in r.stderr, (name, r.stderr)
            assert time.monotonic() - t0 < 30, name  # no model was loaded first
            if name == "up --port":
                assert "make up: PORT=N" in r.stderr


def test_a_crashing_drafter_is_restarted_and_serving_continues(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """SIGKILL to the drafter under `up`: the streams in flight finish with the target's
    own output (plain decoding while it is gone), the launcher restarts it on its port,
    the verifier speculates through it again; a second crash past --max-restarts stops
    everything with a clear message."""
    from transformers import AutoTokenizer

    from tests._faults import SSEClient, greedy_reference_ignore_eos, metric, wait_until

    target, _ = models
    # The target drafts for itself: long accepted paths, so a bad re-sync would show.
    args = ["--target", str(target), "--drafter", str(target)]
    proc, port = launch_up(tmp_path, *args, "--max-restarts", "1", "--restart-window", "600")
    try:
        text = wait_for_line(proc, r"Press Ctrl-C")
        url = f"http://127.0.0.1:{port}"
        engine_metrics = re.search(r"metrics\s+(\S+)\s+\(verifier-0: engine\)", text)
        assert engine_metrics, text
        drafts = "adaserve_spec_decode_num_draft_tokens_total"
        prompts = [[(11 * i + 5 * k) % 90 + 4 for k in range(6 + i)] for i in range(4)]
        tok = AutoTokenizer.from_pretrained(target)
        refs = [
            tok.decode(greedy_reference_ignore_eos(target, p, 400), skip_special_tokens=True)
            for p in prompts
        ]
        clients = [SSEClient(url, p, 400, model="target") for p in prompts]
        wait_until("streams flowing", lambda: all(len(c.frames) >= 3 for c in clients), 60)
        before = metric(engine_metrics[1], drafts)
        assert before > 0, "no speculation before the crash"
        os.kill(_child_pids(text)["drafter-0"], signal.SIGKILL)
        assert not all(c.completed for c in clients), "the streams ended before the crash"
        text = wait_for_line(proc, r"restarted drafter-0\s+pid \d+", timeout=60)
        assert "drafter-0 exited with -9; restarting it in 1 s" in text
        for c, ref in zip(clients, refs, strict=True):
            c.join()
            assert c.completed and c.transport_error is None, c.frames[-2:]
            assert c.text() == ref
        # Speculation resumes on the new drafter.
        after = metric(engine_metrics[1], drafts)

        def drafted_again() -> bool:
            SSEClient(url, prompts[0], 40, model="target").join()
            return metric(engine_metrics[1], drafts) > after

        wait_until("drafting on the restarted drafter", drafted_again, timeout=60)
        assert proc.p.poll() is None, "the launcher stopped"
        # A second crash within the window is one more than --max-restarts 1 allows.
        pids = _child_pids(text)
        os.kill(pids["drafter-0"], signal.SIGKILL)
        assert proc.p.wait(60) == 1
        out = proc.log_path.read_text()
        assert "drafter-0 exited with -9 (2 exits in 600 s); stopping everything" in out
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids.values()), pids
    finally:
        proc.stop(signal.SIGKILL)
