"""Random workloads: does a policy win on workloads nobody tuned it for (issue 34)?

`adaserve simulate --sweep random --n N --seed S --out DIR` draws N workloads from the
space below, finds for each the request rate where the best baseline attains 0.7-0.9
of its SLOs, runs every policy there and writes one table (`random_sweep.md`,
`random_sweep.json`) and one plot (`random_sweep.png`).

The space (`draw_workload`; every draw from `numpy.random.default_rng([seed, i])`, so
workload i of a seed is the same whatever N or the worker count):

- hardware: the shipped profiles (`adaserve/sim/profiles`) in turn, workload i on
  profile i mod 4, so every profile gets a quarter of the draws;
- 2-4 request classes, weights Dirichlet(1, ..., 1) (each at least 0.05);
- per class: TPOT SLO 1.0x-6x the profile's baseline (log-uniform); with probability
  1/2 a TTFT SLO of 2-10x (log-uniform) what the profile takes to prefill the class's
  95th-percentile prompt alone, plus 0.3 s; prompt length lognormal, mean 32-8,192 tokens
  (log-uniform: chat-short to long-document summarization), sigma 0.2-0.8; output
  length lognormal, mean 16-1,024 tokens, sigma 0.2-0.8, clipped to [16, 1024]; drafter
  confidence top-1 ~ Beta(a, 1) with a 0.8-4 (chain acceptance ~0.45-0.8 per token);
- arrivals: Poisson, gamma (CV 1-3) or on-off bursts (the rate `burst` times the mean
  for an `on` share of each period, the rest at what keeps the mean), a third each;
- the workload's engine settings are the defaults with `max_running` 64 and the
  profile's budget and cost cap (what `adaserve simulate` applies to any workload):
  nothing is tuned to the draw. `--set-all KEY=VALUE` changes a setting for every
  policy, the rate search's included: the same draws on another deployment (e.g.
  `engine.max_batch_tokens=2048`, vLLM's default on most GPUs, for the default 512).

Each trace lasts the sweep's duration, or longer where the rate is low, to hold
MIN_REQUESTS requests on average. The rate: bisection (in log rate) on the better of
`spec-2` and `cb-priority` (a fixed chain and not speculating, the two baselines that
win where the other loses), at the sweep's duration and seed, until it attains within
[0.7, 0.9] (at most 5 points; else the one closest to 0.8). Every baseline then runs at
that rate. Where the best of them attains above the band (a third policy beats both
references, e.g. a deep chain on a launch-bound GPU), the bisection goes on, from that
rate up, on that baseline alone (at most 5 points, 2 such rounds), and every baseline
runs again where it ends (unless no point there came nearer the band's middle): the
best baseline, whichever it is, attains within the band, so a workload is not judged
at a load where one baseline meets every SLO. Not where no point of the first search
attained below the band: there attainment barely falls with load (no TTFT SLO, loose
TPOT SLOs) and every policy meets nearly every SLO at any rate. Policy adaserve
then runs at the rate; every baseline's run is the search's own.

Compared: `adaserve` against the best *baseline*, the best of every other policy
(`paper`, spec-1..4, specinfer, cb, cb-priority) per workload, picked by attainment
(goodput on ties): violations ratio = (best's violations + 1) / (adaserve's + 1) (> 1:
adaserve misses fewer; the +1 keeps workloads nobody misses on finite), goodput ratio =
adaserve's / the best's. And against `cb-priority` (the same engine not speculating):
adaserve must attain at least as much. `--set KEY=VALUE` changes policy adaserve's
settings only (with `--reuse`, over the same rates and traces): a candidate change is
measured against the baselines as they are. `--fresh-trace K` (with `--reuse`) runs
every policy again at the reused rates on other traces (simulator seed + K): whether the
comparison holds on traffic the rate search never saw, and adaserve against the
baseline that was best on the reused trace (what a user who tuned on that traffic would
deploy; the best of eight on one trace also wins part of its margin by chance). Per
workload the table also names the class where adaserve loses most to the best baseline
(`random_report.worst_class`), with both policies' TTFT and TPOT attainment there: which phase misses.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from adaserve.sim.workload import Workload

if TYPE_CHECKING:
    from adaserve.sim.costmodel import HardwareProfile

PROFILES = (
    "llama-3.1-70b-tp4-a100",
    "qwen2.5-32b-tp2-a100",
    "llama-3.1-8b-h100",
    "smollm2-135m-cpu",
)
POLICIES = (
    "adaserve",
    "paper",
    "spec-1",
    "spec-2",
    "spec-3",
    "spec-4",
    "specinfer",
    "cb",
    "cb-priority",
)
REFERENCE = ("spec-2", "cb-priority")  # the rate search's first baselines
BAND = (0.7, 0.9)  # the best baseline's attainment the rate search aims for
ROUNDS = 2  # at most this many baselines the search goes on with past the references
MORE_STEPS = 5  # points per baseline past the references (rates up to 32x theirs)

# The space's bounds (tests check draws against them).
CLASSES = (2, 4)
TPOT_SCALE = (1.0, 6.0)  # x the profile's baseline TPOT
TTFT_FACTOR = (2.0, 10.0)  # x the mean prompt's prefill alone, + TTFT_FLOOR_MS
TTFT_FLOOR_MS = 300.0
TTFT_PROB = 0.5
PROMPT_MEAN = (32.0, 8192.0)
OUTPUT_MEAN = (16.0, 1024.0)
OUTPUT_CLIP = (16, 1024)
SIGMA = (0.2, 0.8)
TOP1_ALPHA = (0.8, 4.0)
GAMMA_CV = (1.0, 3.0)
BURST = (2.0, 5.0)  # on-off: rate while on, x the mean
BURST_ON = (0.1, 0.3)  # share of each period that is on
BURST_PERIODS = (2, 6)  # periods per trace
MIN_WEIGHT = 0.05
# A trace lasts the sweep's duration or, at low rates, long enough to hold this many
# requests on average: a 60 s trace at 0.3 req/s would judge a policy on 18 requests.
MIN_REQUESTS = 60


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def draw_workload(
    seed: int, index: int, duration_s: float = 60.0, deployment: dict[str, Any] | None = None
) -> Workload:
    """Workload `index` of the space for `seed` (module docstring). `deployment`:
    settings every policy runs with on top of the space's (`--set-all`), e.g. another
    `engine.max_batch_tokens`; the draw itself does not change."""
    from adaserve.sim.costmodel import load_profile
    from adaserve.sim.driver import merge_settings

    rng = np.random.default_rng([seed, index])
    profile_name = PROFILES[index % len(PROFILES)]
    profile = load_profile(profile_name)
    n = int(rng.integers(CLASSES[0], CLASSES[1] + 1))
    w = rng.dirichlet(np.ones(n))
    w = np.maximum(w, MIN_WEIGHT)
    w /= w.sum()
    classes: dict[str, dict[str, Any]] = {}
    for k in range(n):
        scale = _log_uniform(rng, *TPOT_SCALE)
        # Prompts longer than the context leaves beside the longest output are clipped.
        p_max = min(int(PROMPT_MEAN[1]) * 2, profile.max_model_len - OUTPUT_CLIP[1] - 16)
        p_mean = min(_log_uniform(rng, *PROMPT_MEAN), p_max / 1.5)
        o_mean = _log_uniform(rng, *OUTPUT_MEAN)
        p_sigma = float(rng.uniform(*SIGMA))
        slo: dict[str, Any] = {"baseline_scale": round(scale, 3)}
        if rng.uniform() < TTFT_PROB:
            factor = _log_uniform(rng, *TTFT_FACTOR)
            # Against the class's 95th-percentile prompt, not its mean: an SLO that a
            # twentieth of the prompts cannot meet even alone judges no policy.
            p95 = min(p_max, p_mean * math.exp(1.645 * p_sigma - p_sigma**2 / 2))
            alone = profile.prefill_ms(max(1, round(p95)))
            slo["ttft_ms"] = round(TTFT_FLOOR_MS + factor * alone, 1)
        classes[f"c{k}"] = {
            "weight": round(float(w[k]), 4),
            "slo": slo,
            "prompt_tokens": {
                "dist": "lognormal",
                "mean": round(p_mean, 1),
                "sigma": round(p_sigma, 3),
                "min": 8,
                "max": p_max,
            },
            "output_tokens": {
                "dist": "lognormal",
                "mean": round(o_mean, 1),
                "sigma": round(float(rng.uniform(*SIGMA)), 3),
                "min": OUTPUT_CLIP[0],
                "max": OUTPUT_CLIP[1],
            },
            "draft": {"top1_alpha": round(float(rng.uniform(*TOP1_ALPHA)), 3), "top1_beta": 1.0},
        }
    kind = ("poisson", "gamma", "bursts")[int(rng.integers(3))]
    arrivals: dict[str, Any] = {"process": "poisson"}
    desc = "poisson"
    if kind == "gamma":
        cv = float(rng.uniform(*GAMMA_CV))
        arrivals = {"process": "gamma", "cv": round(cv, 3)}
        desc = f"gamma cv {cv:.1f}"
    elif kind == "bursts":
        burst = float(rng.uniform(*BURST))
        on = float(rng.uniform(*BURST_ON))
        periods = int(rng.integers(BURST_PERIODS[0], BURST_PERIODS[1] + 1))
        arrivals = {"process": "piecewise"}
        profile_pts = _on_off(burst, on, periods)
        for c in classes.values():
            c["rate_profile"] = profile_pts
        desc = f"bursts x{burst:.1f} {on:.0%} on, {periods} periods"
    names = ", ".join(
        f"{c['weight']:.2f}: tpot {c['slo']['baseline_scale']:.1f}x"
        + (f" ttft {c['slo']['ttft_ms'] / 1000:.1f}s" if "ttft_ms" in c["slo"] else "")
        + f" p{c['prompt_tokens']['mean']:.0f}/o{c['output_tokens']['mean']:.0f}"
        for c in classes.values()
    )
    # Validated as a workload file would be: the plain dicts become its typed parts.
    return Workload.model_validate(
        {
            "name": f"random-{seed}-{index}",
            "description": f"{profile_name}; {desc}; {names}",
            "profile": profile_name,
            "duration_s": duration_s,
            "seed": seed,
            "arrivals": arrivals,
            "classes": classes,
            "settings": merge_settings({"engine": {"max_running": 64}}, deployment or {}),
        }
    )


def _on_off(burst: float, on: float, periods: int) -> list[tuple[float, float]]:
    """A piecewise rate profile of `periods` on-off periods: `burst` x the mean while on
    (the first `on` of each period), the rest at the rate that keeps the mean (at least
    0.05 x it; `_piecewise` renormalizes). Edges are 0.1% of the trace wide."""
    off = max((1.0 - burst * on) / (1.0 - on), 0.05)
    pts: list[tuple[float, float]] = []
    eps = 1e-3
    for i in range(periods):
        t0 = i / periods
        t_on = t0 + on / periods
        if i:
            pts.append((t0, off))
        pts += [(t0 + (eps if i else 0.0), burst), (t_on, burst), (t_on + eps, off)]
    pts.append((1.0, off))
    return [(round(x, 6), round(y, 4)) for x, y in pts]


def initial_rate(workload: Workload) -> float:
    """A first guess at the rate the workload saturates: requests a second that 32
    running requests decoding (at the profile's 32-token verify) and each prompt's
    prefill alone keep the server busy for. The bisection corrects it."""
    from adaserve.sim.driver import workload_profile

    profile = workload_profile(workload)
    total = sum(c.weight for c in workload.classes.values())
    busy_s = 0.0
    for c in workload.classes.values():
        p = c.prompt_tokens.mean or (c.prompt_tokens.min + c.prompt_tokens.max) / 2
        o = c.output_tokens.mean or (c.output_tokens.min + c.output_tokens.max) / 2
        per_token = profile.verify_ms(32, 0) / 32.0
        busy_s += c.weight / total * (profile.prefill_ms(round(p)) + o * per_token) / 1000.0
    return 1.0 / max(busy_s, 1e-6)


def _simulate(
    workload: Workload,
    policy: str,
    rps: float,
    overrides: dict[str, Any] | None = None,
    trace_offset: int = 0,
) -> dict[str, Any]:
    from adaserve.sim.driver import simulate

    duration = max(workload.duration_s, MIN_REQUESTS / rps)
    seed = workload.seed + trace_offset
    s = simulate(
        workload, policy, rps=rps, duration_s=duration, seed=seed, overrides=overrides
    ).summary
    keep = (
        "policy",
        "rps",
        "requests",
        "violations",
        "slo_attainment",
        "ttft_attainment",
        "tpot_attainment",
        "goodput",
        "mean_accepted",
        "mean_batch",
    )
    out = {k: s.get(k) for k in keep}
    out["per_class"] = {
        name: {
            k: m.get(k)
            for k in ("requests", "slo_attainment", "ttft_attainment", "tpot_attainment")
        }
        for name, m in s["per_class"].items()
    }
    return out


def find_rate(
    workload: Workload,
    baselines: Sequence[str] = (),
    band: tuple[float, float] = BAND,
    reference: Sequence[str] = REFERENCE,
    max_steps: int = 5,
) -> tuple[float, dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """(rate, runs at it, every point tried): bisection in log rate on the better
    reference's attainment until it lies in `band` (or `max_steps` runs; then the point
    closest to the band's middle). Then every baseline runs there. Where the best of them
    attains above the band (a third policy beats both references at a load where
    neither is stressed), the bisection goes on from that rate up, on that baseline
    alone, for at most ROUNDS such policies and MORE_STEPS points each; where it finds
    no point nearer the band's middle (attainment falls off a cliff between two rates
    the bisection cannot resolve), the rate it started from stays. Not where no
    point tried attained below the band: that workload's attainment barely falls with
    load (no TTFT SLO, loose TPOT SLOs), and more load would only cost simulation. The
    runs: every reference and baseline at the rate."""
    every = tuple(dict.fromkeys((*reference, *baselines)))
    mid = sum(band) / 2
    rate, runs, tried = _bisect(workload, reference, initial_rate(workload), band, max_steps)
    for _ in range(ROUNDS):
        runs |= {p: _simulate(workload, p, rate) for p in every if p not in runs}
        best = max(runs, key=lambda p: runs[p]["slo_attainment"] or 0.0)
        att = runs[best]["slo_attainment"] or 0.0
        if att <= band[1] or all(t["attainment"] > band[1] for t in tried):
            break
        further, runs_there, more = _bisect(
            workload, (best,), 2.0 * rate, band, MORE_STEPS, lo=rate
        )
        tried += more
        if abs((runs_there[best]["slo_attainment"] or 0.0) - mid) >= abs(att - mid):
            break  # no nearer the band past a cliff: the rate it started from stays
        rate, runs = further, runs_there
    # Every baseline at the rate kept (a no-op unless the last round moved it).
    runs |= {p: _simulate(workload, p, rate) for p in every if p not in runs}
    return rate, runs, tried


def _bisect(
    workload: Workload,
    policies: Sequence[str],
    rate: float,
    band: tuple[float, float],
    max_steps: int,
    lo: float | None = None,
) -> tuple[float, dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Bisection in log rate from `rate` on the best of `policies` (`lo`: a rate known to
    attain above the band): (rate in the band, or the one closest to its middle, the
    runs there, every point tried)."""
    hi = None  # a rate known to attain below the band
    tried: list[dict[str, Any]] = []
    best: tuple[float, float, dict[str, dict[str, Any]]] | None = None
    mid = sum(band) / 2
    for _ in range(max_steps):
        runs = {p: _simulate(workload, p, rate) for p in policies}
        att = max(r["slo_attainment"] or 0.0 for r in runs.values())
        tried.append({"rps": rate, "attainment": att, "policies": list(policies)})
        if best is None or abs(att - mid) < abs(best[1] - mid):
            best = (rate, att, runs)
        if band[0] <= att <= band[1]:
            return rate, runs, tried
        if att > band[1]:
            lo = rate
            rate = math.sqrt(rate * hi) if hi else rate * 2.0
        else:
            hi = rate
            rate = math.sqrt(rate * lo) if lo else rate / 2.0
    assert best is not None
    return best[0], best[2], tried


def run_workload(
    args: tuple[
        Workload, Sequence[str], dict[str, Any] | None, Sequence[str], dict[str, Any] | None, int
    ],
) -> dict[str, Any]:
    """One workload: the rate search, then every policy at the rate found. `reused`: this
    workload's result from an earlier sweep (same draw): its rate and every policy's
    run are kept but those in `rerun`. `ours`: settings for policy adaserve's run only
    (the baselines and the rate search never see them). `fresh` > 0: every policy runs
    again at the reused rate on another trace (the simulator seed plus `fresh`), and the
    result also says how adaserve does there against the baseline that was best on the
    reused trace: the one a user who tuned on that traffic would run."""
    workload, policies, reused, rerun, ours, fresh = args
    if reused is not None:
        rate, tried = reused["rps"], reused["search"]
        runs = {} if fresh else {p: r for p, r in reused["policies"].items() if p not in rerun}
    else:
        rate, runs, tried = find_rate(workload, [p for p in policies if p != "adaserve"])
    results = {
        p: runs[p]
        if p in runs
        else _simulate(workload, p, rate, ours if p == "adaserve" else None, fresh)
        for p in policies
    }
    out = {
        "name": workload.name,
        "profile": workload.profile,
        "profile_digest": profile_digest(workload.profile),
        "description": workload.description,
        "workload": workload.model_dump(mode="json"),
        "rps": rate,
        "search": tried,
        "policies": results,
        **compare(results),
    }
    if fresh and reused is not None:  # (run_random_sweep refuses `fresh` without one)
        chosen = reused["best_baseline"]
        out["trace_offset"] = fresh
        out["chosen_on_reused"] = chosen
        out["violations_ratio_chosen"] = violations_ratio(results[chosen], results["adaserve"])
    return out


@functools.cache
def profile_digest(name: str) -> str:
    """A digest of a shipped profile's tables (not its name or description) and of what
    the simulator charges from them at a grid of forwards (`charges`): a reused result
    measured on other tables, or priced by another reading of them, runs again whole
    (`run_random_sweep`). Once per profile and process: neither changes under a sweep."""
    from adaserve.sim.costmodel import load_profile

    profile = load_profile(name)
    tables = profile.model_dump(mode="json", exclude={"name", "description"})
    blob = json.dumps({"tables": tables, "charges": charges(profile)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def charges(profile: HardwareProfile) -> list[float]:
    """What the cost model charges for a grid of forwards (target: trees beside chunks
    over some context; drafter: steps and chunk ingestion), rounded to a nanosecond."""
    target = [
        profile.forward_ms(t, p, c)
        for t in (0, 1, 4, 16, 64, 256)
        for p in (0, 1, 8, 16, 64, 512)
        for c in (0, 4096)
        if t or p
    ]
    drafter = [profile.draft_forward_ms(n) for n in (1, 8, 64, 512, 2048)]
    return [round(x, 6) for x in target + drafter]


def violations_ratio(theirs: dict[str, Any], ours: dict[str, Any]) -> float:
    """(their violations + 1) / (ours + 1): above 1, ours misses fewer; the +1 keeps a
    workload nobody misses on finite."""
    return (theirs["violations"] + 1) / (ours["violations"] + 1)


def compare(results: dict[str, dict[str, Any]], policy: str = "adaserve") -> dict[str, Any]:
    """The module docstring's ratios of `policy` against the best other policy and
    against cb-priority."""
    ours = results[policy]
    others = {p: r for p, r in results.items() if p != policy}
    if not others:
        return {}
    best_name = max(others, key=lambda p: (others[p]["slo_attainment"], others[p]["goodput"]))
    best = others[best_name]
    out: dict[str, Any] = {
        "best_baseline": best_name,
        "violations_ratio": violations_ratio(best, ours),
        "goodput_ratio": ours["goodput"] / best["goodput"] if best["goodput"] else math.inf,
    }
    cbp = results.get("cb-priority")
    if cbp is not None:
        out["attainment_vs_cb_priority"] = ours["slo_attainment"] - cbp["slo_attainment"]
        out["goodput_vs_cb_priority"] = (
            ours["goodput"] / cbp["goodput"] if cbp["goodput"] else math.inf
        )
    return out


def run_random_sweep(
    n: int,
    seed: int,
    duration_s: float = 60.0,
    policies: Sequence[str] = POLICIES,
    workers: int = 1,
    progress: bool = True,
    reuse: Sequence[dict[str, Any]] = (),
    rerun: Sequence[str] = ("adaserve",),
    partial: Path | None = None,
    overrides: dict[str, Any] | None = None,
    deployment: dict[str, Any] | None = None,
    fresh: int = 0,
) -> list[dict[str, Any]]:
    """One result per workload, in index order (the same for any worker count).
    `reuse`: the workloads of an earlier sweep's JSON; one drawn alike (same seed,
    index, duration and code, on the same profile tables) keeps its rate and its runs of every policy not in
    `rerun`, so a change to policy adaserve alone re-runs only it, on the same traces.
    `partial`: a JSON file rewritten with the workloads done so far, in order.
    `overrides`: adaserve settings (`--set`) for policy adaserve's runs: a candidate
    change measured on the sweep before it becomes a default. `deployment`: settings
    for every policy's runs, the rate search's included (`--set-all`): the same sweep
    on another deployment (a reused workload drawn under other settings runs again).
    `fresh` > 0: every policy again, at the reused rates, on fresh traces (`run_workload`)."""
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    if fresh < 0:
        raise ValueError(f"--fresh-trace must be >= 1 (0: off), got {fresh}")
    if "adaserve" not in policies:
        raise ValueError("the random sweep compares policy adaserve: include it")
    earlier = {r["name"]: r for r in reuse}
    tasks = []
    for i in range(n):
        wl = draw_workload(seed, i, duration_s, deployment)
        old = earlier.get(wl.name)
        if old is not None and (
            old["workload"] != wl.model_dump(mode="json")
            # its profile re-measured since, or a result that cannot tell (no digest)
            or old.get("profile_digest") != profile_digest(wl.profile)
        ):
            old = None  # drawn differently (another duration, generator or profile): run it all
        if fresh and old is None:
            raise ValueError(f"--fresh-trace: {wl.name} is not in the reused sweep (drawn alike)")
        tasks.append((wl, tuple(policies), old, tuple(rerun), overrides, fresh))
    from tqdm import tqdm

    bar = tqdm(total=n, desc="random sweep", disable=not progress, file=sys.stderr, leave=False)
    out: list[dict[str, Any]] = []

    def done(r: dict[str, Any]) -> None:
        out.append(r)
        bar.update(1)
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"workloads": out}) + "\n")

    if workers <= 1:
        for t in tasks:
            done(run_workload(t))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for r in pool.map(run_workload, tasks):
                done(r)
    bar.close()
    return out
