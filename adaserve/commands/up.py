"""`adaserve up`: the whole system on localhost, one process per service.

    adaserve up --target PATH --drafter PATH [--tp N] [--verifier-units K] [--port 8000]
    adaserve up --all-in-one ...   # one verifier with in-process drafter and scheduler

Starts scheduler, drafter(s), verifier(s) and gateway on free loopback ports, waits
until every one is healthy (gRPC health, then the gateway's /ready), prints the URLs
and stops them all cleanly on Ctrl-C or SIGTERM. A service that exits while serving is
restarted on its own port after a backoff (1 s, doubling per recent exit, at most 30 s):
a drafter or scheduler coming back is invisible to clients (the verifier decodes plainly
or selects in process meanwhile, then re-syncs). Only a service that exits more than
`--max-restarts` times within `--restart-window` seconds stops the launcher. Each service runs in its own process
group, so a verifier's tensor-parallel ranks go down with it, and a terminal Ctrl-C
reaches only the launcher, which then stops the services in reverse order.

Each service writes one log file in one format (JSON lines, or `--log-format text`)
under `./logs/up-<date>-<time>/` (`--log-dir`); `./logs/latest` points at the newest.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from adaserve.config import ATTENTION_BACKEND_CHOICES

STOP_TIMEOUT_S = 10.0
MAX_BACKOFF_S = 30.0
DEFAULT_METRICS_PORT = 9400  # services/verifier/__main__.py's default, for unit 0


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="embedded", help="target model (PATH or embedded)")
    parser.add_argument(
        "--drafter",
        default="embedded",
        help="drafter: a draft model or an EAGLE head (PATH, embedded, embedded-eagle, or none)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per unit")
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKEND_CHOICES,
        help="model.attention_backend of every verifier and drafter (default: settings)",
    )
    parser.add_argument(
        "--verifier-units",
        type=int,
        default=1,
        metavar="K",
        help="serving units (a verifier and its drafter each)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    parser.add_argument(
        "--grpc-port", type=int, default=0, help="gateway gRPC port (0: a free one)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="engine Prometheus port of verifier unit 0; unit k gets this + k (0: none)",
    )
    parser.add_argument(
        "--all-in-one",
        action="store_true",
        help="one verifier with in-process drafter and scheduler",
    )
    parser.add_argument("--config", help="YAML settings file passed to every service")
    parser.add_argument(
        "--log-dir",
        help="service logs, one file per service (default: ./logs/up-<date>-<time>/, "
        "with ./logs/latest pointing at it)",
    )
    parser.add_argument(
        "--log-format",
        choices=("json", "text"),
        default="json",
        help="every service's log lines: JSON objects or plain text",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restart a service that exits while serving, up to N times within "
        "--restart-window; one more exit stops everything (0: stop at the first)",
    )
    parser.add_argument(
        "--restart-window",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the window --max-restarts counts exits in",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every service to become healthy",
    )


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


def make_log_dir(requested: str | None, root: Path = Path("logs")) -> Path:
    """The run's log directory: `requested`, or a new `root/up-<date>-<time>` with
    `root/latest` pointing at it, so `tail -f logs/latest/verifier-0.log` follows the
    newest run without looking up its name."""
    if requested:
        path = Path(requested)
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(100):  # two launches in the same second get distinct directories
        path = root / (f"up-{stamp}" if n == 0 else f"up-{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{root}/up-{stamp}-*: too many runs this second")
    latest = root / "latest"
    with contextlib.suppress(OSError):  # a convenience: never fail the launch over it
        tmp = root / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.name)
        tmp.replace(latest)  # atomic, also over an existing link
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan(args: argparse.Namespace, log_dir: Path) -> list[Service]:
    """The services to start, in start order (stopped in reverse)."""
    loop = "127.0.0.1"
    cfg = ["--config", args.config] if args.config else []
    cfg += ["--log-format", args.log_format]
    # Model flags for the processes that load a model (verifiers, drafters).
    model_flags = ["--attention-backend", args.attention_backend] if args.attention_backend else []
    drafter = None if args.drafter in (None, "", "none") else args.drafter
    services: list[Service] = []
    verifiers: list[str] = []
    # Torch processes that compute at the same time on these cores (a unit's drafter
    # and verifier take turns, so one unit does not count)?
    shared = args.tp > 1 or (not args.all_in_one and args.verifier_units > 1)
    # Another torch process beside each verifier, loading while the verifier would
    # time the hardware?
    beside = shared or (not args.all_in_one and drafter is not None)

    def add(
        name: str,
        argv: list[str],
        port: int | None,
        metrics_url: str | None = None,
        settle_first: bool = False,
    ) -> None:
        addr = f"{loop}:{port}" if port is not None else None
        log = log_dir / f"{name}.log"
        services.append(Service(name, [*argv, *cfg], addr, log, metrics_url, shared, settle_first))

    def add_verifier(name: str, port: int, extra: list[str]) -> None:
        # The engine's metrics (iteration phases, spec decode, fallbacks) live in the
        # verifier process, not behind the gateway's /metrics: each unit has its own
        # port, fixed so that a scrape config survives a restart.
        m_port = metrics_ports(args)[len(verifiers)] if args.metrics_port else 0
        argv = ["verifier", "--host", loop, "--port", str(port), "--target", args.target]
        argv += ["--tp", str(args.tp), "--metrics-port", str(m_port), *model_flags, *extra]
        url = f"http://{loop}:{m_port}/metrics" if m_port else None
        # Beside a drafter process, start once it has loaded: the verifier times the
        # hardware at startup.
        add(name, argv, port, url, settle_first=beside)
        verifiers.append(f"{loop}:{port}")

    if args.all_in_one:
        add_verifier("verifier-0", free_port(), ["--drafter", drafter or "none"])
    else:
        sched_port = free_port()
        add("scheduler", ["scheduler", "--host", loop, "--port", str(sched_port)], sched_port)
        for k in range(args.verifier_units):
            extra: list[str] = ["--scheduler-address", f"{loop}:{sched_port}"]
            if drafter:
                d_port = free_port()
                add(
                    f"drafter-{k}",
                    [
                        "drafter",
                        *("--host", loop, "--port", str(d_port), "--model", drafter),
                        *model_flags,
                    ],
                    d_port,
                )
                extra += ["--drafter-address", f"{loop}:{d_port}"]
            else:
                extra += ["--drafter", "none"]
            add_verifier(f"verifier-{k}", free_port(), extra)
    grpc_port = args.grpc_port or free_port()
    gw = ["gateway", "--host", args.host, "--port", str(args.port), "--grpc-port", str(grpc_port)]
    for v in verifiers:
        gw += ["--verifier", v]
    add("gateway", gw, None, settle_first=True)  # after the verifiers timed the hardware
    return services


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies (prctl
    PR_SET_PDEATHSIG; the launcher starts services from its main thread only, whose
    exit is the launcher's)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def metrics_ports(args: argparse.Namespace) -> list[int]:
    """Unit k's engine metrics port: --metrics-port + k (none with --metrics-port 0)."""
    if not args.metrics_port:
        return []
    return [args.metrics_port + k for k in range(args.verifier_units)]


def check_ports(args: argparse.Namespace) -> str | None:
    """The ports the user chose (or the defaults) that are already taken, before any
    service starts: a clash otherwise shows only once a verifier has loaded its model."""
    from services.common.ports import PortInUse, check_free

    wanted = [(args.host, args.port, "--port N (make up: PORT=N)")]
    if args.grpc_port:
        wanted.append((args.host, args.grpc_port, "--grpc-port N (0: a free one)"))
    hint = "--metrics-port N (unit k gets N + k; 0: no engine metrics)"
    wanted += [("127.0.0.1", p, hint) for p in metrics_ports(args)]
    for host, port, flag in wanted:
        try:
            check_free(host, port, flag)
        except PortInUse as exc:
            return str(exc)
    return None


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


def _slo_units(base: str) -> list[dict] | None:
    import httpx

    try:
        return httpx.get(f"{base}/v1/slo", timeout=5.0).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None  # e.g. API keys configured: the URLs above still hold


def _unsettled(units: list[dict]) -> bool:
    return any(not u.get("baseline", {}).get("settled", True) for u in units)


def slo_lines(base: str, units: list[dict] | None = None) -> str:
    """What the console says: each unit's measured baseline and the SLO each class
    resolved to (from the gateway's /v1/slo); empty if it cannot be read."""
    from adaserve.slo import describe

    units = _slo_units(base) if units is None else units
    if units is None:
        return ""
    lines = []
    for u in units:
        classes = {name: c["tpot_ms"] for name, c in u["classes"].items()}
        text = describe(u["baseline_tpot_ms"], classes, u["default_class"], u["slo_floor_ms"])
        where = f" ({u['unit']})" if len(units) > 1 else ""
        lines.append(f"  SLOs{where:<7} {text}\n")  # aligned with "  OpenAI API  "
    note = f"  (GET {base}/v1/slo; SLOs below the floor run best-effort)\n"
    if _unsettled(units):
        note += (
            "  (baselines are measured again once the server is idle; a faster value "
            "replaces a busy start's, and the new SLOs are printed here)\n"
        )
    return "".join(lines) + note


def follow_slos(base: str, stopping: threading.Event, period_s: float = 5.0) -> None:
    """While a unit's baseline is unsettled (adaserve/calibration.py), print the SLOs
    again whenever a unit's baseline changes, so a console that showed a busy start's
    loose SLOs ends up showing the quiet host's."""
    shown = _slo_units(base)
    while shown is not None and _unsettled(shown) and not stopping.wait(period_s):
        now = _slo_units(base)
        if now is None:
            continue
        if [u["baseline_tpot_ms"] for u in now] != [u["baseline_tpot_ms"] for u in shown]:
            print(f"adaserve up: baseline re-measured\n{slo_lines(base, now)}", end="", flush=True)
        shown = now


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


def _validate(args: argparse.Namespace) -> str | None:
    if args.verifier_units < 1:
        return "--verifier-units must be >= 1"
    if args.all_in_one and args.verifier_units != 1:
        return "--all-in-one runs exactly one verifier unit"
    if args.tp < 1:
        return "--tp must be >= 1"
    if not 0 < args.port < 65536:
        return "--port must be in 1..65535"
    if not 0 <= args.grpc_port < 65536:
        return "--grpc-port must be in 0..65535"
    if args.max_restarts < 0:
        return "--max-restarts must be >= 0 (0: stop at the first exit)"
    if not args.restart_window > 0:
        return "--restart-window must be > 0 seconds"
    if args.metrics_port and not 0 < args.metrics_port + args.verifier_units <= 65536:
        return "--metrics-port must leave room for one port per unit below 65536 (0: none)"
    return None


def run(args: argparse.Namespace) -> int:
    if (err := _validate(args)) is not None:
        print(f"adaserve up: {err}", file=sys.stderr)
        return 2
    from adaserve.config import load_settings
    from services.common import tls

    try:  # the services read the same file and environment
        tls.configure(load_settings(args.config).tls)
    except (OSError, ValueError) as exc:
        print(f"adaserve up: {exc}", file=sys.stderr)
        return 2
    if (err := check_ports(args)) is not None:
        print(f"adaserve up: {err}", file=sys.stderr)
        return 2
    from adaserve.cpu_load import current, oversubscription

    # Verifier units and their TP ranks compute at the same time; a drafter process
    # waits while its verifier computes.
    for warning in oversubscription(current(), args.verifier_units * args.tp):
        print(f"adaserve up: warning: {warning}", file=sys.stderr, flush=True)
    try:
        log_dir = make_log_dir(args.log_dir)
    except OSError as exc:
        print(f"adaserve up: cannot create the log directory: {exc}", file=sys.stderr)
        return 2
    services = plan(args, log_dir)
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    base = f"http://{shown}:{args.port}"
    launcher = Launcher(
        services, f"{base}/ready", RestartPolicy(args.max_restarts, args.restart_window)
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: launcher.stopping.set())
    mode = "all-in-one" if args.all_in_one else f"{args.verifier_units} unit(s)"
    print(f"adaserve up ({mode}): starting {len(services)} services, logs in {log_dir}", flush=True)
    code = 0
    try:
        launcher.start_all(args.startup_timeout)
        grpc_port = services[-1].args[services[-1].args.index("--grpc-port") + 1]
        engine_metrics = "".join(
            f"  metrics     {svc.metrics_url}  ({svc.name}: engine)\n"
            for svc in services
            if svc.metrics_url
        )
        print(
            f"adaserve is up.\n"
            f"  OpenAI API  {base}/v1\n"
            f"  gRPC API    {shown}:{grpc_port}\n"
            f"  metrics     {base}/metrics  (gateway)\n"
            f"{engine_metrics}"
            f"{slo_lines(base)}"
            f"Press Ctrl-C to stop.",
            flush=True,
        )
        threading.Thread(target=follow_slos, args=(base, launcher.stopping), daemon=True).start()
        code = launcher.watch()
    except KeyboardInterrupt:
        code = 0
    except RuntimeError as exc:
        print(f"adaserve up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        print("adaserve up: stopping services", flush=True)
        launcher.stop_all()
        print("adaserve up: stopped", flush=True)
    return code
