"""Two verifier units behind one gateway, one of them killed mid-stream: its stream
ends with a clean error (no hang, no [DONE] that would pass it off as complete), new
requests go to the survivor, and the dead unit is re-admitted once it is back."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests._serving import Proc, make_served_model, start_gateway, start_verifier

pytestmark = pytest.mark.slow  # three serving processes

LONG = {
    "model": "tiny",
    "prompt": "go",
    "max_tokens": 480,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


class Stream:
    """A streaming completion read on its own thread, frames kept as they arrive."""

    def __init__(self, url: str) -> None:
        self.frames: list[str] = []
        self.first = threading.Event()
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        self.frames.append(line)
                        self.first.set()
        except Exception as exc:  # recorded: the test decides what was acceptable
            self.error = exc
        finally:
            self.first.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "stream hung"


def _units(url: str) -> dict[str, dict]:
    return {u["address"]: u for u in httpx.get(f"{url}/ready").json()["units"]}


def _wait(cond: Callable[[], bool], timeout: float = 30.0, why: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"condition not reached {why()}"
        time.sleep(0.1)


def _one_stream_per_unit(url: str, streams: list[Stream]) -> None:
    """Least outstanding requests: two concurrent streams land on different units."""
    for s in streams:
        assert s.first.wait(30) and s.frames, s.error
    _wait(
        lambda: all(u["outstanding"] == 1 for u in _units(url).values()),
        timeout=10,
        why=lambda: f"units {_units(url)} first frames {[s.frames[:1] for s in streams]}",
    )


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_served_model(tmp_path_factory.mktemp("failover") / "target", seed=0)


@pytest.fixture
def two_units(target: Path, tmp_path: Path) -> Iterator[tuple[str, list[Proc], list[str]]]:
    procs: list[Proc] = []
    addrs: list[str] = []
    gw = None
    try:
        for name in ("unit-a", "unit-b"):
            proc, addr = start_verifier(tmp_path, target, None, name=name)
            procs.append(proc)
            addrs.append(addr)
        cfg = tmp_path / "gw.yaml"
        cfg.write_text("gateway:\n  health_interval_s: 0.5\n")
        args = [a for addr in addrs for a in ("--verifier", addr)]
        gw, url = start_gateway(tmp_path, *args, "--config", str(cfg), wait_path="/ready")
        _wait(lambda: all(u["healthy"] for u in _units(url).values()))
        yield url, procs, addrs
    finally:
        if gw is not None:
            gw.stop()
        for p in procs:
            p.stop()


def test_unit_killed_mid_stream(two_units, target: Path, tmp_path: Path) -> None:
    url, procs, addrs = two_units
    streams = [Stream(url), Stream(url)]
    _one_stream_per_unit(url, streams)

    procs[0].stop(signal.SIGKILL)
    t0 = time.monotonic()
    for s in streams:
        s.join(60)
    failed = [s for s in streams if s.frames[-1] != "data: [DONE]"]
    assert len(failed) == 1, [s.frames[-1] for s in streams]
    last = json.loads(failed[0].frames[-1][len("data: ") :])
    assert last["error"]["type"] == "service_unavailable_error"
    assert time.monotonic() - t0 < 30

    # New requests all succeed: the dead unit is dropped (or retried past).
    for _ in range(3):
        r = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 3, "stream": False})
        assert r.status_code == 200, r.text
    _wait(lambda: not _units(url)[addrs[0]]["healthy"])

    # Back on the same address: re-admitted by the health checks.
    port = int(addrs[0].rsplit(":", 1)[1])
    procs[0], _ = start_verifier(tmp_path, target, None, name="unit-a-again", port=port)
    _wait(lambda: _units(url)[addrs[0]]["healthy"])
    _one_stream_per_unit(url, [Stream(url), Stream(url)])
