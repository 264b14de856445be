"""The processes of `adaserve up`: each service started in its own process group with
the environment its OpenMP threads need, waited on until healthy (gRPC health, or the
gateway's /ready), restarted after an exit with a backoff, and stopped in reverse order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

STOP_TIMEOUT_S = 10.0
MAX_BACKOFF_S = 30.0


def service_env(base: os._Environ | dict[str, str], shared_cpu: bool = False) -> dict[str, str]:
    """A service's environment, for how its OpenMP threads wait between ops.

    Each service does its torch work on one thread (adaserve/torch_thread.py). A torch
    process that has the cores to itself while it computes should let its workers spin
    between a forward's ops, since a futex wake-up per op costs ~40% on a 2-core host;
    GOMP_SPINCOUNT=30000 runs a forward at libgomp's default speed and stops spinning
    ten times sooner after it. That holds for one process (all-in-one) and for a
    verifier and its drafter, which take turns (draft, then verify). Torch processes
    that compute at the same time (`shared_cpu`: several units, TP ranks) must sleep
    instead, or their spinning workers steal the cores the other one needs
    (OMP_WAIT_POLICY=PASSIVE). A GOMP_SPINCOUNT or OMP_WAIT_POLICY the user set wins.
    Measured in `BENCHMARKS.md` ("Layouts")."""
    env = {**base, "PYTHONUNBUFFERED": "1"}
    if "GOMP_SPINCOUNT" not in base and "OMP_WAIT_POLICY" not in base:
        if shared_cpu:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            env["GOMP_SPINCOUNT"] = "30000"
    return env


@dataclass
class Service:
    name: str
    args: list[str]  # after `adaserve`
    grpc_address: str | None  # checked with gRPC health; None: the gateway (HTTP /ready)
    log_path: Path
    metrics_url: str | None = None  # the service's own Prometheus endpoint, if it has one
    shared_cpu: bool = False  # torch processes compute at once on this host (service_env)
    # Start only once the services before it are healthy: a verifier times the hardware
    # at startup (`slo.baseline_tpot_ms: auto`), which a model loading beside it skews.
    settle_first: bool = False
    proc: subprocess.Popen | None = field(default=None, repr=False)
    exits: deque[float] = field(default_factory=deque, repr=False)  # while serving
    restart_at: float | None = None  # monotonic time of a pending restart

    def start(self) -> subprocess.Popen:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it from here
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adaserve.cli", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=service_env(os.environ, self.shared_cpu),
            start_new_session=True,  # own process group: TP ranks die with it
            # A launcher killed outright (SIGKILL, OOM) cannot stop its services: they
            # get SIGTERM from the kernel instead of serving on as orphans.
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        log.close()
        return self.proc

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        # The whole group, even after the leader exited: its TP ranks may linger.
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies (prctl
    PR_SET_PDEATHSIG; the launcher starts services from its main thread only, whose
    exit is the launcher's)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # exits within window_s that are restarted; one more stops all
    window_s: float = 60.0
    backoff_s: float = 1.0  # before the first restart; doubles per recent exit

    def delay_s(self, recent_exits: int) -> float:
        return min(self.backoff_s * 2 ** max(recent_exits - 1, 0), MAX_BACKOFF_S)


class Launcher:
    def __init__(
        self, services: list[Service], ready_url: str, restarts: RestartPolicy | None = None
    ) -> None:
        self.services = services
        self.ready_url = ready_url
        self.restarts = restarts or RestartPolicy()
        self.stopping = threading.Event()

    def start_all(self, timeout_s: float) -> None:
        """Starts every service and waits until all are healthy; raises RuntimeError
        (with the failing service's log) when one exits or the timeout passes. A
        service with `settle_first` starts only once the ones before it are healthy."""
        deadline = time.monotonic() + timeout_s
        pending: list[Service] = []
        for svc in self.services:
            if svc.settle_first:
                self._wait_healthy(pending, deadline, timeout_s)
            proc = svc.start()
            print(f"  started {svc.name:<12} pid {proc.pid:<7} log {svc.log_path}", flush=True)
            pending.append(svc)
        self._wait_healthy(pending, deadline, timeout_s)

    def _wait_healthy(self, pending: list[Service], deadline: float, timeout_s: float) -> None:
        """Until every service in `pending` is healthy (removing each as it gets there)."""
        while pending:
            if self.stopping.is_set():
                raise KeyboardInterrupt
            for svc in list(pending):
                self._check_alive(svc)
                if self._healthy(svc):
                    pending.remove(svc)
                    print(f"  healthy {svc.name}", flush=True)
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {names}")
            if pending:
                self.stopping.wait(0.25)

    def watch(self) -> int:
        """Blocks until a signal (returns 0) or a service exits more often than the
        restart policy allows (returns 1); restarts the ones that exit before that."""
        while not self.stopping.wait(0.25):
            now = time.monotonic()
            for svc in self.services:
                if svc.restart_at is not None:
                    if now >= svc.restart_at:
                        svc.restart_at = None
                        proc = svc.start()
                        print(f"  restarted {svc.name:<10} pid {proc.pid:<7}", flush=True)
                    continue
                code = svc.exited()
                if code is not None and not self._schedule_restart(svc, code, now):
                    return 1
        return 0

    def _schedule_restart(self, svc: Service, code: int, now: float) -> bool:
        """False when `svc` exited too often to go on (the launcher then stops all)."""
        policy = self.restarts
        svc.exits.append(now)
        while svc.exits and now - svc.exits[0] > policy.window_s:
            svc.exits.popleft()
        recent = len(svc.exits)
        if recent > policy.max_restarts:
            why = (
                f"{recent} exits in {policy.window_s:g} s"
                if policy.max_restarts
                else "restarts are off (--max-restarts 0)"
            )
            print(
                f"adaserve up: {svc.name} exited with {code} ({why}); stopping everything\n"
                f"{svc.log_tail()}",
                file=sys.stderr,
                flush=True,
            )
            return False
        delay = policy.delay_s(recent)
        svc.signal(signal.SIGKILL)  # leftovers of its group (TP ranks) hold its ports
        svc.restart_at = now + delay
        print(
            f"adaserve up: {svc.name} exited with {code}; restarting it in {delay:g} s "
            f"(exit {recent} of {policy.max_restarts} allowed in {policy.window_s:g} s)\n"
            f"{svc.log_tail(10)}",
            file=sys.stderr,
            flush=True,
        )
        return True

    def stop_all(self) -> None:
        for svc in reversed(self.services):
            svc.signal(signal.SIGTERM)
            if svc.proc is None:
                continue
            try:
                svc.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"  {svc.name} ignored SIGTERM; killing it", file=sys.stderr)
                svc.signal(signal.SIGKILL)
                svc.proc.wait()
            svc.signal(signal.SIGKILL)  # leftovers of its group (TP ranks)

    def _check_alive(self, svc: Service) -> None:
        code = svc.exited()
        if code is not None:
            raise RuntimeError(f"{svc.name} exited with {code} during startup:\n{svc.log_tail()}")

    def _healthy(self, svc: Service) -> bool:
        if svc.grpc_address is None:
            return _http_ok(self.ready_url)
        return _grpc_serving(svc.grpc_address)


def _grpc_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.options import channel

    with channel(address) as ch:  # mutual TLS when the services use it
        try:
            # typeshed's HealthStub stub omits the Check attribute the real class sets
            reply = health_pb2_grpc.HealthStub(ch).Check(  # pyright: ignore[reportAttributeAccessIssue]
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
