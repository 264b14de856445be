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
This module plans the services from the flags; launcher.py runs them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from adaserve.commands.launcher import Launcher, RestartPolicy, Service
from adaserve.config import ATTENTION_BACKEND_CHOICES

DEFAULT_METRICS_PORT = 9400  # services/verifier/__main__.py's default, for unit 0


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
