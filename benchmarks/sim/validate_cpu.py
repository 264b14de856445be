"""Simulator against the real server on this machine (issue 7's validation).

    .venv/bin/python benchmarks/sim/validate_cpu.py [--measure] [--rps 0.25,0.5,1.0]
        [--window 10] [--trace-passes 4] [--reuse-real]

1. `--measure`: `adaserve profile` times the embedded pair here and records an
   acceptance trace (random token-id prompts, the kind `bench serve` sends), into the
   files `workloads/cpu-embedded.yaml` names.
2. Starts the real system (`adaserve up`, all services as processes unless
   `--all-in-one`) with the workload's settings and the profile's budget.
3. For each rate: `adaserve bench serve` replays the workload's trace against it, and
   the engine's metrics record what the hardware did meanwhile (verify, draft and
   prefill time per iteration, from `adaserve_iteration_seconds{phase}`): read before
   and after the run, and by a background thread every `--window` seconds (default
   10) during it, so each window of the run has its own per-iteration phase times.
   The polls are stored in OUT/real-rpsR/summary.json (`server_windows`, times in
   seconds since the load generator's start, the trace's time 0), next to the
   run-wide `server_costs`, so `--reuse-real` can redo every fit without a server.
4. `adaserve simulate` runs the same trace (same seed, rate, duration) three ways:
   - profile as measured;
   - one scale per run: the profile's verify, draft and prefill tables scaled so the
     simulated phase times match the ones recorded over the whole run (`fit_scale`);
   - speed over time: the profile's tables with a `speed_trace` (a factor per phase
     and window, costmodel.py) fitted so the simulated verify and draft time per
     iteration match the server's in every window (`fit_speed_trace`).
   The fitted ones add the run's host time per iteration (streaming, bookkeeping:
   `phase="host"`) to every simulated iteration as the profile's
   `iteration_overhead_ms`. The fits are needed because this shared 2-core host
   drifts: the same forward takes 36-125 ms from one minute to the next, so a profile
   measured before the runs cannot describe all of them, and one scale per run fits
   the mean while near saturation the slow minutes decide attainment. Only costs are
   fitted; attainment and goodput are predicted.
5. Prints and writes (OUT/validation.md, OUT/validation.json) attainment and goodput
   side by side, overall and per class: absolute attainment points and relative goodput
   difference, against the 10% the issue asks for; a first table puts the three
   simulations' overall differences next to each other.

Runs saved without windows (before `--window`), or with `--window 0`, cannot fit a
speed over time: their "speed over time" column repeats one scale per run, marked so.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from adaserve.bench import PROMPT_VOCAB

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _server import start_up, stop_up  # noqa: E402

ADASERVE = [sys.executable, "-m", "adaserve"]
WORKLOAD = ROOT / "workloads/cpu-embedded.yaml"


def sh(cmd: list[str], **kw) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kw)


def measure(workload: dict, base: Path, shared_cpu: bool) -> None:
    """Under the environment `adaserve up` gives the verifier in the layout being
    validated (how idle OpenMP threads wait changes the cost of a small forward), five
    repetitions a point."""
    from adaserve.commands.launcher import service_env

    profile = (base / workload["profile"]).resolve()
    trace = (base / workload["acceptance"]["trace"]).resolve()
    sh(
        [
            *ADASERVE,
            "profile",
            "--reps",
            "5",
            "--target",
            "embedded",
            "--drafter",
            "embedded",
            "--out",
            str(profile),
            "--trace",
            str(trace),
            "--trace-random-prompts",
            ",".join(map(str, PROMPT_VOCAB)),
            "--trace-prompt-len",
            "60",
            "--trace-prompts",
            "16",
            "--trace-steps",
            "24",
            "--trace-depth",
            "4",
            "--trace-width",
            "2",
        ],
        env=service_env(os.environ, shared_cpu),
    )


def server_settings(workload_path: Path) -> dict:
    """Exactly the scheduler, SLO and speculation settings the simulator gives the `adaserve` policy
    (budget and draft cost from the profile, the workload's overrides), so both sides
    plan and select alike."""
    from adaserve.sim.driver import engine_settings, workload_profile
    from adaserve.sim.policies import policy_spec
    from adaserve.sim.workload import load_workload

    wl = load_workload(workload_path)
    profile = workload_profile(wl)
    spec = policy_spec("adaserve", max_running=1)  # max_running: unused by adaserve
    settings = engine_settings(wl, profile, spec)
    out = settings.model_dump(mode="json", include={"scheduler", "slo", "speculation"})
    out["engine"] = {"max_running": settings.engine.max_running}
    return out


def engine_metrics_url(log: Path) -> str | None:
    """`adaserve up` prints each verifier's metrics endpoint (the engine's counters)."""
    for line in log.read_text().splitlines():
        if "(verifier-0" in line and "/metrics" in line:
            return line.split()[1]
    return None


PHASES = ("speculate", "select", "verify", "prefill", "host")


def server_counters(url: str | None) -> dict[str, float]:
    """The engine's cumulative counters: spec-decode tokens, iterations, phase seconds."""
    if url is None:
        return {}
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    vals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("adaserve_"):
            name, value = line.rsplit(" ", 1)
            vals[name] = float(value)
    out = {
        "emitted": vals.get("adaserve_spec_decode_num_emitted_tokens_total", 0.0),
        "drafts": vals.get("adaserve_spec_decode_num_drafts_total", 0.0),
        "iterations": vals.get("adaserve_iterations_total", 0.0),
        "batch_sum": vals.get("adaserve_batch_size_sum", 0.0),
        "tokens_sum": vals.get("adaserve_budget_used_tokens_sum", 0.0),
    }
    for ph in PHASES:
        out[f"{ph}_s"] = vals.get(f'adaserve_iteration_seconds_sum{{phase="{ph}"}}', 0.0)
    return out


def server_costs(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the hardware did during one run: per-iteration phase times (ms), prefill
    total (ms), mean batch and tree tokens, tokens per verification step."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    it = max(d.get("iterations", 0.0), 1.0)
    return {
        "iterations": d.get("iterations", 0.0),
        # selection is real CPU time in the simulator too, but its clock does not see it
        "verify_ms_per_iter": 1000 * (d.get("verify_s", 0.0) + d.get("select_s", 0.0)) / it,
        "draft_ms_per_iter": 1000 * d.get("speculate_s", 0.0) / it,
        "prefill_ms_total": 1000 * d.get("prefill_s", 0.0),
        # streaming and bookkeeping between the phases: the profile's iteration overhead
        "host_ms_per_iter": 1000 * d.get("host_s", 0.0) / it,
        "mean_batch": d.get("batch_sum", 0.0) / it,
        "mean_tree_tokens": d.get("tokens_sum", 0.0) / it,
        "mean_accepted": d["emitted"] / d["drafts"] if d.get("drafts") else None,
    }


class CounterPoller:
    """Reads the engine's counters every `interval_s` seconds in a background thread,
    on a grid from `start()`, plus once at `start()` and once at `stop()`. Each poll is
    `server_counters` with `t_s`, the monotonic time since `start()` halfway through
    the request. A poll that fails (a busy server) is skipped."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url, self.interval_s = url, interval_s
        self.polls: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.t0, self.t0_unix = time.monotonic(), time.time()
        self._poll()
        self._thread.start()

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self._thread.join()
        self._poll()
        return self.polls

    def _run(self) -> None:
        k = 1
        while not self._stop.wait(max(0.0, self.t0 + k * self.interval_s - time.monotonic())):
            self._poll()
            k = int((time.monotonic() - self.t0) // self.interval_s) + 1

    def _poll(self) -> None:
        sent = time.monotonic()
        try:
            counters = server_counters(self.url)
        except (OSError, ValueError):
            return
        self.polls.append({"t_s": (sent + time.monotonic()) / 2 - self.t0, **counters})


def real_windows(real: dict) -> list[dict] | None:
    """The run's polled windows, from `server_windows`: per window its bounds (t0_s,
    t1_s, seconds since the load generator's start) and `server_costs` over it. None
    when the run has no polls (saved before `--window`, or with `--window 0`)."""
    saved = real.get("server_windows") or {}
    polls = saved.get("polls") or []
    if len(polls) < 2:
        return None
    interval = saved.get("interval_s") or 0.0
    if len(polls) > 2 and polls[-1]["t_s"] - polls[-2]["t_s"] < interval / 2:
        polls = polls[:-2] + polls[-1:]  # a short last window joins the one before
    out = []
    for a, b in itertools.pairwise(polls):
        if b["t_s"] <= 0:
            continue  # wholly before the trace started (the load generator starting up)
        out.append({"t0_s": a["t_s"], "t1_s": b["t_s"], **server_costs(a, b)})
    return out or None


def sim_windows(sim: dict, windows: list[dict], overhead_ms: float) -> list[dict]:
    """The simulation's phase time over the real windows: each of its fine windows
    (`phase_windows`, SIM_WINDOW_S) goes to the real window holding its midpoint (later
    ones, past the end of the real run, to none). Per-iteration verify (without the
    iteration overhead, as `sim_costs`) and draft ms, and iterations."""
    fine = sim["phase_windows"]
    ends = [w["t1_s"] for w in windows]
    acc = [{"iterations": 0, "verify_ms": 0.0, "draft_ms": 0.0} for _ in windows]
    for row in fine["windows"]:
        j = bisect.bisect_right(ends, row["t_s"] + fine["window_s"] / 2)
        if j < len(acc):
            for key in acc[j]:
                acc[j][key] += row[key]
    out = []
    for a in acc:
        it = max(a["iterations"], 1)
        out.append(
            {
                "iterations": a["iterations"],
                "verify_ms_per_iter": a["verify_ms"] / it - overhead_ms,
                "draft_ms_per_iter": a["draft_ms"] / it,
            }
        )
    return out


def compare(real: dict, sim: dict) -> dict:
    def row(r: dict, s: dict) -> dict:
        gr, gs = float(r["goodput"]), float(s["goodput"])
        return {
            "attainment_real": r["slo_attainment"],
            "attainment_sim": s["slo_attainment"],
            "attainment_diff_pts": 100 * (s["slo_attainment"] - r["slo_attainment"]),
            "goodput_real": gr,
            "goodput_sim": gs,
            "goodput_rel_diff": (gs - gr) / gr if gr > 0 else (0.0 if gs == 0 else float("inf")),
            "tpot_p50_real": r.get("tpot_p50_ms"),
            "tpot_p50_sim": s.get("tpot_p50_ms"),
        }

    out = {"overall": row(real, sim)}
    for name, r in real["per_class"].items():
        out[name] = row(r, sim["per_class"].get(name, {"slo_attainment": 0.0, "goodput": 0.0}))
    # both over steps that verified a draft (root-only steps are not in the server's counters)
    out["mean_accepted"] = {
        "real": real.get("mean_accepted"),
        "sim": sim.get("mean_emitted_per_draft", sim.get("mean_accepted")),
    }
    return out


def render(results: dict[str, dict]) -> str:
    lines = [
        "| rps | scope | attainment real | sim | diff (pts) | goodput real (tok/s) | sim | diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rps, res in results.items():
        for scope, c in res.items():
            if scope == "mean_accepted":
                continue
            lines.append(
                f"| {rps} | {scope} | {c['attainment_real']:.3f} | {c['attainment_sim']:.3f} | "
                f"{c['attainment_diff_pts']:+.1f} | {c['goodput_real']:.1f} | {c['goodput_sim']:.1f} | "
                f"{100 * c['goodput_rel_diff']:+.1f}% |"
            )
    lines.append("")
    for rps, res in results.items():
        m = res["mean_accepted"]
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(
            f"- {rps} req/s: tokens per verification step with a draft, real {fmt(m['real'])}, "
            f"sim {fmt(m['sim'])}"
        )
    return "\n".join(lines) + "\n"


def render_side_by_side(raw: dict, scaled: dict, over_time: dict, traces: dict) -> str:
    """Overall differences of the three simulations, one row per rate."""
    lines = [
        "| rps | attainment real | diff: as measured | one scale per run | speed over time "
        "| goodput real (tok/s) | diff: as measured | one scale per run | speed over time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rps, res in raw.items():
        cols = [res, scaled.get(rps), over_time.get(rps)]
        pts = [f"{c['overall']['attainment_diff_pts']:+.1f}" if c else "n/a" for c in cols]
        rel = [f"{100 * c['overall']['goodput_rel_diff']:+.1f}%" if c else "n/a" for c in cols]
        if "fallback" in traces.get(rps, {}):
            pts[2] += " (one scale: no windows)"
            rel[2] += " (one scale: no windows)"
        o = res["overall"]
        lines.append(
            f"| {rps} | {o['attainment_real']:.3f} | {' | '.join(pts)} | "
            f"{o['goodput_real']:.1f} | {' | '.join(rel)} |"
        )
    return "\n".join(lines) + "\n"


def describe_trace(t: dict) -> str:
    if "fallback" in t:
        return f"not fitted ({t['fallback']})"
    vs = [p["verify"] for p in t["speed_trace"]]
    ds = [p["draft"] for p in t["speed_trace"]]
    fitted = sum(w["iterations_real"] > 0 for w in t["windows"])
    return (
        f"{len(vs)} windows of {t['window_s']:g} s ({fitted} with iterations), verify "
        f"x{min(vs):.2f}-{max(vs):.2f}, draft x{min(ds):.2f}-{max(ds):.2f}, "
        f"host {t['host_ms']:.1f} ms per iteration"
    )


def simulate(
    workload: Path,
    rps: float,
    duration: float,
    seed: int,
    out: Path,
    phase_window: float | None = None,
) -> dict:
    window = ["--phase-window", str(phase_window)] if phase_window else []
    sh(
        [
            *ADASERVE,
            "simulate",
            str(workload),
            "--policy",
            "adaserve",
            "--out",
            str(out),
            "--quiet",
            "--no-plots",
            "--rps",
            str(rps),
            "--duration",
            str(duration),
            "--seed",
            str(seed),
            *window,
        ],
        stdout=subprocess.DEVNULL,
    )
    return json.loads((out / "summary.json").read_text())


def scaled_workload(
    scale: dict[str, float],
    out: Path,
    overhead_ms: float = 0.0,
    speed_trace: list[dict] | None = None,
) -> Path:
    """The workload with its profile's verify, draft and prefill tables multiplied by
    `scale`: the same shape, at the speed the host actually ran during one real run,
    plus that run's host time per iteration as the profile's iteration overhead, and
    `speed_trace` (factors over time on top of the tables) when given."""
    from adaserve.sim.costmodel import load_profile

    wl = yaml.safe_load(WORKLOAD.read_text())
    prof = yaml.safe_load((WORKLOAD.parent / wl["profile"]).read_text())
    # SLOs stay where the real run had them: they scale the profile's own baseline
    prof["baseline_tpot_ms"] = load_profile(WORKLOAD.parent / wl["profile"]).baseline_ms()
    prof["verify"]["ms"] = [[m * scale["verify"] for m in row] for row in prof["verify"]["ms"]]
    prof["draft_step"]["ms"] = [m * scale["draft"] for m in prof["draft_step"]["ms"]]
    prof["prefill"]["ms"] = [m * scale["prefill"] for m in prof["prefill"]["ms"]]
    if prof.get("mixed"):  # forwards carrying trees and chunks: the verify phase's time
        prof["mixed"]["ms"] = [[m * scale["verify"] for m in row] for row in prof["mixed"]["ms"]]
    prof["iteration_overhead_ms"] = overhead_ms
    if speed_trace is not None:
        prof["speed_trace"] = speed_trace
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile-scaled.yaml").write_text(yaml.safe_dump(prof, sort_keys=False))
    wl["profile"] = str((out / "profile-scaled.yaml").resolve())
    wl["acceptance"]["trace"] = str((WORKLOAD.parent / wl["acceptance"]["trace"]).resolve())
    path = out / "cpu-embedded-scaled.yaml"
    path.write_text(yaml.safe_dump(wl, sort_keys=False))
    return path


def sim_costs(sim: dict, overhead_ms: float = 0.0) -> dict[str, float]:
    it = max(sim["iterations"], 1)
    return {  # the simulator's verify time includes the profile's iteration overhead
        "verify_ms_per_iter": sim["verify_ms_total"] / it - overhead_ms,
        "draft_ms_per_iter": sim["draft_ms_total"] / it,
        "prefill_ms_total": sim["prefill_ms_total"],
    }


def fit_scale(real: dict, rps: float, duration: float, seed: int, out: Path) -> dict:
    """Fixed point: simulate, compare the simulated per-iteration verify and draft time
    and the prefill total with what the server's phase metrics recorded in the same run,
    rescale the profile's tables by the ratio, repeat. Only costs are fitted (what the
    hardware did); attainment and goodput are then the simulator's prediction. The
    server's host time per iteration is taken as measured (`host_ms`)."""
    costs = real["server_costs"]
    host = costs.get("host_ms_per_iter", 0.0)
    scale = {"verify": 1.0, "draft": 1.0, "prefill": 1.0}
    for _ in range(4):
        wl = scaled_workload(scale, out, host)
        sim = simulate(wl, rps, duration, seed, out / "fitting")
        got = sim_costs(sim, host)
        for key, field in (
            ("verify", "verify_ms_per_iter"),
            ("draft", "draft_ms_per_iter"),
            ("prefill", "prefill_ms_total"),
        ):
            if got[field] > 0 and costs[field] > 0:
                scale[key] *= costs[field] / got[field]
    return {**scale, "host_ms": host}


UNSCALED = {"verify": 1.0, "draft": 1.0, "prefill": 1.0}
# The simulation reports phase time per second; the fit sums those seconds into the
# polled windows (whose bounds need not fall on whole seconds).
SIM_WINDOW_S = 1.0
# Bound on one pass's correction of a window's factor: a window with few iterations
# must not send its factor far off in one step.
MAX_STEP = 2.0


def speed_trace(windows: list[dict], factors: list[dict[str, float]]) -> list[dict]:
    """The profile's `speed_trace`: each window's factors from its start on (the first
    window, which starts before the trace does, from 0)."""
    return [{"t_s": max(0.0, w["t0_s"]), **f} for w, f in zip(windows, factors, strict=True)]


def fit_speed_trace(
    real: dict, scale: dict, rps: float, duration: float, seed: int, out: Path, passes: int = 4
) -> dict | None:
    """`fit_scale` per window: the speed factors of every polled window start at the
    run-wide scale; then simulate, compare each window's simulated verify and draft
    time per iteration with the server's in that window, and multiply the window's
    factor by real / simulated (bounded by MAX_STEP a pass), `passes` times. A window
    where either side ran no iteration keeps its factor (the run-wide one unless an
    earlier pass fitted it). Prefill runs on the same cores as verify but too rarely
    to fit per window: its factor moves with the verify factor (run-wide prefill
    scale x window verify factor / run-wide verify scale). Host time stays the run's
    mean. None when the run has no polled windows. Only costs are fitted."""
    windows = real_windows(real)
    if windows is None:
        return None
    host = scale["host_ms"]
    factors = [{k: scale[k] for k in UNSCALED} for _ in windows]
    fields = (("verify", "verify_ms_per_iter"), ("draft", "draft_ms_per_iter"))
    for _ in range(passes):
        wl = scaled_workload(UNSCALED, out, host, speed_trace(windows, factors))
        sim = simulate(wl, rps, duration, seed, out / "fitting", SIM_WINDOW_S)
        for f, w, g in zip(factors, windows, sim_windows(sim, windows, host), strict=True):
            if w["iterations"] <= 0 or g["iterations"] <= 0:
                continue
            for key, field in fields:
                if w[field] > 0 and g[field] > 0:
                    f[key] *= min(MAX_STEP, max(1 / MAX_STEP, w[field] / g[field]))
            f["prefill"] = scale["prefill"] * f["verify"] / scale["verify"]
    return {
        "host_ms": host,
        "window_s": real["server_windows"].get("interval_s") or 0.0,
        "speed_trace": speed_trace(windows, factors),
    }


def window_fit(real: dict, sim: dict, host_ms: float) -> list[dict]:
    """Per window, what the fitted simulation did against the server (diagnostics)."""
    windows = real_windows(real) or []
    got = sim_windows(sim, windows, host_ms) if windows else []
    return [
        {
            "t0_s": round(w["t0_s"], 2),
            "t1_s": round(w["t1_s"], 2),
            "iterations_real": w["iterations"],
            "iterations_sim": g["iterations"],
            "verify_ms_per_iter_real": w["verify_ms_per_iter"],
            "verify_ms_per_iter_sim": g["verify_ms_per_iter"],
            "draft_ms_per_iter_real": w["draft_ms_per_iter"],
            "draft_ms_per_iter_sim": g["draft_ms_per_iter"],
        }
        for w, g in zip(windows, got, strict=True)
    ]


def run_real(up_args: list[str], rates: list[float], duration: float, args) -> dict:
    """Start the server, replay the workload at each rate, stop it."""
    up_log = args.out / "up.log"
    server = start_up(up_args, args.port, up_log)
    url = f"http://127.0.0.1:{args.port}"
    reals: dict[float, dict] = {}
    try:
        metrics = None
        for _ in range(30):  # `up` prints the endpoints just after the gateway is ready
            if (metrics := engine_metrics_url(up_log)) is not None:
                break
            time.sleep(0.5)
        for rps in rates:
            real_dir = args.out / f"real-rps{rps}"
            before = server_counters(metrics)
            poller = CounterPoller(metrics, args.window) if metrics and args.window > 0 else None
            if poller is not None:
                poller.start()
            try:
                sh(
                    [
                        *ADASERVE,
                        "bench",
                        "serve",
                        str(WORKLOAD),
                        "--url",
                        url,
                        "--out",
                        str(real_dir),
                        "--label",
                        "real",
                        "--quiet",
                        "--rps",
                        str(rps),
                        "--duration",
                        str(duration),
                        "--seed",
                        str(args.seed),
                    ]
                )
            finally:  # a failed run leaves no thread behind
                polls = poller.stop() if poller is not None else []
            after = server_counters(metrics)
            real = json.loads((real_dir / "summary.json").read_text())
            if after:  # bench serve cannot see verification steps or phase times
                real["server_costs"] = server_costs(before, after)
                real["mean_accepted"] = real["server_costs"]["mean_accepted"]
            if poller is not None:
                # the load generator's start (the trace's time 0) on the poller's clock
                start = real.get("started_unix_s", poller.t0_unix) - poller.t0_unix
                for poll in polls:
                    poll["t_s"] -= start
                real["server_windows"] = {
                    "interval_s": args.window,
                    "bench_start_s": start,  # after the poller's first read
                    "polls": polls,
                }
            if after or poller is not None:
                (real_dir / "summary.json").write_text(json.dumps(real, indent=2))
            reals[rps] = real
    finally:
        stop_up(server)
    return reals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help="re-measure profile and trace first")
    ap.add_argument("--rps", default="0.3,0.6,0.9")
    ap.add_argument("--duration", type=float, help="trace seconds (default: the workload's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8077)
    ap.add_argument("--all-in-one", action="store_true")
    ap.add_argument(
        "--reuse-real",
        action="store_true",
        help="reuse the OUT/real-rps*/ runs (and their polled windows) instead of a server",
    )
    ap.add_argument(
        "--window",
        type=float,
        default=10.0,
        help="seconds between the engine-counter polls during each real run, the windows "
        "of the speed-over-time fit (0: no polls, no such fit)",
    )
    ap.add_argument(
        "--trace-passes", type=int, default=4, help="simulate-and-rescale passes of that fit"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/sim/results/validation")
    args = ap.parse_args()

    workload = yaml.safe_load(WORKLOAD.read_text())
    if args.measure:
        # without --all-in-one a drafter process shares the CPU (adaserve up's rule)
        measure(workload, WORKLOAD.parent, shared_cpu=not args.all_in_one)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = args.out / "server.yaml"
    cfg.write_text(yaml.safe_dump(server_settings(WORKLOAD)))
    duration = args.duration or float(workload["duration_s"])
    rates = [float(x) for x in args.rps.split(",")]
    up_args = ["--config", str(cfg), "--log-dir", str(args.out / "logs")]
    if args.all_in_one:
        up_args.append("--all-in-one")
    reals: dict[float, dict] = {}
    if args.reuse_real:
        reals = {r: json.loads((args.out / f"real-rps{r}/summary.json").read_text()) for r in rates}
    else:
        reals = run_real(up_args, rates, duration, args)

    uncalibrated = {
        str(r): compare(
            reals[r], simulate(WORKLOAD, r, duration, args.seed, args.out / f"sim-raw-rps{r}")
        )
        for r in rates
    }
    scales: dict[str, dict] = {}
    results: dict[str, dict] = {}
    traces: dict[str, dict] = {}
    over_time: dict[str, dict] = {}
    for r in rates:
        if "server_costs" not in reals[r]:
            continue  # a run from before the server exported its phase times
        scales[str(r)] = fit_scale(reals[r], r, duration, args.seed, args.out / f"fit-rps{r}")
        s = scales[str(r)]
        wl = scaled_workload(s, args.out / f"fit-rps{r}", s["host_ms"])
        results[str(r)] = compare(
            reals[r], simulate(wl, r, duration, args.seed, args.out / f"sim-rps{r}")
        )
        fit_dir = args.out / f"fit-trace-rps{r}"
        fit = fit_speed_trace(reals[r], s, r, duration, args.seed, fit_dir, args.trace_passes)
        if fit is None:
            print(
                f"{r} req/s: the saved real run has no polled windows (from before --window, "
                "or --window 0): 'speed over time' falls back to one scale per run",
                flush=True,
            )
            traces[str(r)] = {"fallback": "no polled windows: one scale per run"}
            over_time[str(r)] = results[str(r)]
            continue
        wl = scaled_workload(UNSCALED, fit_dir, fit["host_ms"], fit["speed_trace"])
        sim = simulate(wl, r, duration, args.seed, args.out / f"sim-trace-rps{r}", SIM_WINDOW_S)
        traces[str(r)] = {**fit, "windows": window_fit(reals[r], sim, fit["host_ms"])}
        over_time[str(r)] = compare(reals[r], sim)
    report = {
        "cost_scale": scales,
        "server_costs": {str(r): reals[r].get("server_costs") for r in rates},
        "scaled": results,
        "speed_over_time": over_time,
        "speed_trace": traces,
        "uncalibrated": uncalibrated,
        "mode": "all-in-one" if args.all_in_one else "services",
    }
    (args.out / "validation.json").write_text(json.dumps(report, indent=2))
    scale_lines = "\n".join(
        f"- {r} req/s: verify x{s['verify']:.2f}, draft x{s['draft']:.2f}, "
        f"prefill x{s['prefill']:.2f}, host {s.get('host_ms', 0.0):.1f} ms per iteration"
        for r, s in scales.items()
    )
    trace_lines = "\n".join(f"- {r} req/s: {describe_trace(t)}" for r, t in traces.items())
    rerun = " ".join(
        [
            ".venv/bin/python benchmarks/sim/validate_cpu.py --reuse-real",
            *(["--all-in-one"] if args.all_in_one else []),
            f"--rps {args.rps} --duration {duration:g} --out {_rel(args.out)}",
        ]
    )
    text = (
        f"Regenerate (from the real runs' `real-rps*/summary.json`): `{rerun}`.\n\n"
        f"Deployment: {report['mode']}.\n\n"
        "Overall, the three simulations against the real run (attainment: points; "
        "goodput: relative):\n\n"
        + render_side_by_side(uncalibrated, results, over_time, traces)
        + "\nProfile tables scaled per run to the phase times the server's engine recorded "
        "in that run (only costs are fitted; attainment and goodput are predicted):\n\n"
        + scale_lines
        + "\n\n"
        + render(results)
        + "\nSpeed over time: the profile's tables times a speed trace fitted per window "
        "to the phase times the server's engine recorded in that window (only costs are "
        "fitted; attainment and goodput are predicted):\n\n"
        + trace_lines
        + "\n\n"
        + render(over_time)
        + "\nProfile alone (as measured, no scaling):\n\n"
        + render(uncalibrated)
    )
    (args.out / "validation.md").write_text(text)
    print(text)
    return 0


def _rel(path: Path) -> str:
    """`path` relative to the repository when it is inside it (for the rerun command)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
