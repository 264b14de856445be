"""The discrete-event driver: real engines on virtual clocks, fed by a workload trace.

Each serving unit is an unmodified `Engine` with a `LocalScheduler` (the real selection
code), a `SimDrafter` and a `SimTarget` sharing the unit's `VirtualClock`. Events are
processed in time order: the next arrival or the next iteration of the busy unit that
is furthest behind. An idle unit's clock jumps to the arrival that wakes it; a busy unit
takes a new request when its current iteration ends.

Arrivals are routed by the gateway's own code (`adaserve.routing.route`, setting
`fleet.routing` or `simulate(routing=...)`): on each unit's `Engine.load()` read at the
arrival (a report with no delay) and the prefix keys of the prompts it was sent, or by
least outstanding requests.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaserve.config import Settings
from adaserve.engine import Engine, EngineFull, RequestStream
from adaserve.latency import ForwardLatency
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.routing import (
    POLICIES,
    Candidate,
    PrefixLog,
    RouteRequest,
    RoutingParams,
    match_depth,
    route,
    token_keys,
)
from adaserve.scheduler import LocalScheduler
from adaserve.sim.acceptance import BetaDraft, build_acceptance
from adaserve.sim.clock import VirtualClock
from adaserve.sim.costmodel import HardwareProfile, load_profile
from adaserve.sim.drafter import SimDrafter
from adaserve.sim.policies import PolicySpec, policy_spec
from adaserve.sim.summary import RequestRecord, summarize
from adaserve.sim.target import SimTarget
from adaserve.sim.workload import SimRequest, Workload

# Defaults the simulator applies under the workload's own settings: a queue no trace
# overflows (overload shows up as SLO violations, not as rejections).
SIM_DEFAULTS: dict[str, Any] = {"engine": {"max_queue": 10_000_000}}


@dataclass
class Unit:
    index: int
    clock: VirtualClock
    engine: Engine
    target: SimTarget
    drafter: SimDrafter | None
    prefixes: PrefixLog  # the prefix keys of the prompts routed here (routing.py)
    # request id -> (stream, record, the unit's clock when the engine took it)
    active: dict[str, tuple[RequestStream, RequestRecord, float]] = field(default_factory=dict)


@dataclass
class SimResult:
    summary: dict[str, Any]
    records: list[RequestRecord]
    units: list[Unit]
    settings: Settings


def merge_settings(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = (
            merge_settings(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def workload_profile(workload: Workload) -> HardwareProfile:
    local = workload.resolve(workload.profile)
    return load_profile(local if local is not None and local.is_file() else workload.profile)


def draft_cost_tokens(profile: HardwareProfile, budget: int) -> float | None:
    """One drafter step's latency in verifier tokens at the budget: the draft step over
    the verify curve's cost per token just above B (what a deployment reads off its own
    `adaserve profile`). None when the curve is flat there (no cost to trade against)."""
    slope = (profile.verify_ms(2 * budget, 0) - profile.verify_ms(budget, 0)) / budget
    return profile.draft_ms(budget) / slope if slope > 0 else None


def engine_settings(workload: Workload, profile: HardwareProfile, spec: PolicySpec) -> Settings:
    base: dict[str, Any] = {
        "scheduler": {
            "budget": profile.budget,
            "adaptive": {"draft_cost_tokens": draft_cost_tokens(profile, profile.budget)},
        },
        "slo": {"baseline_tpot_ms": profile.baseline_ms()},
    }
    merged = merge_settings(
        merge_settings(merge_settings(base, SIM_DEFAULTS), workload.settings), spec.overrides
    )
    return Settings(**merged)


def simulate(
    workload: Workload,
    policy: str,
    rps: float | None = None,
    duration_s: float | None = None,
    seed: int | None = None,
    k: int | None = None,
    overrides: dict[str, Any] | None = None,
    phase_window_s: float | None = None,
    routing: str | None = None,
) -> SimResult:
    """Replay `workload` under `policy`. `overrides` are adaserve Settings applied over the
    workload's own (a policy's settings still win: spec-K always verifies its chain).
    `phase_window_s`: also report phase time per window of simulated time
    (`phase_windows` in the summary, see `phase_windows`). `routing`: how arrivals pick
    a unit, `slo` or `least_outstanding` (None: the settings' `fleet.routing`)."""
    if phase_window_s is not None and not phase_window_s > 0:
        raise ValueError(f"phase window must be > 0 seconds, got {phase_window_s}")
    if routing is not None and routing not in POLICIES:
        raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {routing!r}")
    if overrides:
        workload = workload.model_copy(
            update={"settings": merge_settings(workload.settings, overrides)}
        )
    profile = workload_profile(workload)
    seed = workload.seed if seed is None else seed
    rps = workload.rps if rps is None else rps
    duration_s = workload.duration_s if duration_s is None else duration_s
    max_running = Settings(**merge_settings(SIM_DEFAULTS, workload.settings)).engine.max_running
    spec = policy_spec(policy, max_running, k)
    settings = engine_settings(workload, profile, spec)
    requests = workload.generate(rps, duration_s, seed, profile.baseline_ms())

    calibration, replay_draft = build_acceptance(workload.acceptance, workload.base_dir)
    samplers = {n: replay_draft or BetaDraft(c.draft) for n, c in workload.classes.items()}
    class_of: dict[str, str] = {r.id: r.slo_class for r in requests}

    def sampler_for(request_id: str):
        return samplers[class_of[request_id]]

    seeds = np.random.SeedSequence(seed).spawn(2 * workload.units)
    units = []
    for u in range(workload.units):
        clock = VirtualClock()
        target = SimTarget(
            profile,
            clock,
            calibration,
            np.random.default_rng(seeds[2 * u]),
            settings.engine.kv_block_size,
            settings.engine.prefix_caching,
        )
        drafter = None
        if spec.speculative:
            drafter = SimDrafter(
                profile, clock, sampler_for, np.random.default_rng(seeds[2 * u + 1]), spec.expansion
            )
        engine = Engine(
            target,
            drafter,
            LocalScheduler(settings.scheduler),
            settings,
            clock=clock,
            model_name=profile.name,
            # The engine plans forwards with the profile's tables at the host's speed of
            # the moment (a live engine's drift factor tracks that within a few
            # iterations), not the knee prior.
            latency=ForwardLatency(
                lambda t, p, _ctx, clock=clock: profile.forward_ms(t, p, 0, clock.now)
            ),
        )
        units.append(Unit(u, clock, engine, target, drafter, PrefixLog(settings.fleet.prefix_keys)))

    fleet = settings.fleet
    params = RoutingParams(routing or fleet.routing, fleet.report_stale_ms / 1000.0, fleet.kv_limit)
    wall0 = time.perf_counter()
    records = _run(units, requests, spec, params)
    wall = time.perf_counter() - wall0
    summary = summarize(
        records,
        policy if k is None else f"spec-{k}",
        rps,
        **_extras(units, settings, profile, duration_s, seed, wall, workload),
        routing=params.policy,
    )
    if phase_window_s is not None:
        summary["phase_windows"] = phase_windows(units, phase_window_s)
    return SimResult(summary, records, units, settings)


def phase_windows(units: list[Unit], window_s: float) -> dict[str, Any]:
    """Phase time per window of `window_s` seconds of simulated time, over all units:
    window i covers [i * window_s, (i + 1) * window_s) and holds the verify, draft and
    prefill ms charged by calls that started in it (verify includes the profile's
    iteration overhead, as `verify_ms_total` does) and its iterations (verifies)."""
    logs = {
        "verify_ms": [e for u in units for e in u.target.stats.verify_log],
        "draft_ms": [e for u in units if u.drafter for e in u.drafter.draft_log],
        "prefill_ms": [e for u in units for e in u.target.stats.prefill_log],
    }
    last = max((t for log in logs.values() for t, _ in log), default=0.0)
    n = int(last // window_s) + 1

    def binned(log: list[tuple[float, float]], weights: bool = True) -> np.ndarray:
        idx = np.array([int(t // window_s) for t, _ in log], dtype=np.int64)
        w = np.array([ms for _, ms in log]) if weights else None
        return np.bincount(idx, weights=w, minlength=n)

    sums = {k: binned(log) for k, log in logs.items()}
    iters = binned(logs["verify_ms"], weights=False)
    return {
        "window_s": window_s,
        "windows": [
            {
                "t_s": i * window_s,
                "iterations": int(iters[i]),
                **{k: float(v[i]) for k, v in sums.items()},
            }
            for i in range(n)
        ],
    }


def _run(
    units: list[Unit], requests: list[SimRequest], spec: PolicySpec, params: RoutingParams
) -> list[RequestRecord]:
    pending = deque(requests)
    ties = itertools.count()  # breaks ties between equally good units, as the gateway
    records: list[RequestRecord] = []
    stalled = 0
    while True:
        busy = [u for u in units if u.engine.has_work()]
        t_unit = min((u.clock.now for u in busy), default=math.inf)
        t_arr = pending[0].arrival_s if pending else math.inf
        if t_arr == math.inf and t_unit == math.inf:
            break
        if t_arr <= t_unit:
            req = pending.popleft()
            unit = _route(units, req, params, ties)
            records.append(_submit(unit, req, spec))
            continue
        unit = min(busy, key=lambda u: (u.clock.now, u.index))
        before = unit.clock.now
        unit.engine.step()
        _drain(unit)
        # Every step either admits, retires or advances time; guard against a bug
        # turning the simulation into a busy loop.
        stalled = stalled + 1 if unit.clock.now == before else 0
        if stalled > 10_000:
            raise RuntimeError("simulation made no progress in 10000 engine steps")
    return records


def _route(
    units: list[Unit], req: SimRequest, params: RoutingParams, ties: itertools.count
) -> Unit:
    """The unit `route` picks, from every unit's load as of now (a zero-delay report)."""
    keys = token_keys(req.prompt_ids(units[0].target.vocab_size))
    request = RouteRequest(req.ttft_slo_ms, req.prompt_tokens, keys)
    cands = [
        Candidate(
            outstanding=len(u.active),
            load=u.engine.load() if params.policy == "slo" else None,
            load_age_s=0.0,
            tpot_slo_ms=req.tpot_slo_ms,
            prefix_match=match_depth(keys, u.prefixes),
        )
        for u in units
    ]
    choices = route(request, cands, params).choices
    unit = units[choices[next(ties) % len(choices)]]
    unit.prefixes.touch(keys)
    return unit


def _submit(unit: Unit, req: SimRequest, spec: PolicySpec) -> RequestRecord:
    if not unit.engine.has_work():
        unit.clock.advance_to(req.arrival_s)
    rec = RequestRecord(
        id=req.id,
        slo_class=req.slo_class,
        tpot_slo_ms=req.tpot_slo_ms,
        arrival_s=req.arrival_s,
        prompt_tokens=req.prompt_tokens,
        max_tokens=req.output_tokens,
        unit=unit.index,
        ttft_slo_ms=req.ttft_slo_ms,
    )
    prompt = req.prompt_ids(unit.target.vocab_size)
    max_tokens, ignore_eos = req.output_tokens, True
    if req.open_ended:  # no max_tokens: the rest of the context; eos after its output
        max_tokens, ignore_eos = unit.engine.max_model_len - len(prompt), False
        unit.target.stop_after[req.id] = req.output_tokens
    greq = GenerationRequest(
        id=req.id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        tpot_slo_ms=req.tpot_slo_ms,
        slo_class=req.slo_class,
        priority=round(req.tpot_slo_ms * 1000) if spec.priority_by_slo else 0,
        ttft_slo_ms=req.ttft_slo_ms,
    )
    try:
        stream = unit.engine.submit(greq)
    except (EngineFull, ValueError) as exc:
        rec.finish_reason, rec.error, rec.finish_s = "rejected", str(exc), unit.clock.now
        return rec
    unit.active[req.id] = (stream, rec, unit.clock.now)
    return rec


def _drain(unit: Unit) -> None:
    """Collect this step's deltas. The engine stamps decode tokens at the end of the
    step (after verification, nothing else advances the clock) and the first token at
    the end of prefill, which its ttft_ms gives exactly."""
    now = unit.clock.now
    done = []
    for rid, (stream, rec, submit_s) in unit.active.items():
        while (delta := stream.get(timeout=0)) is not None:
            if delta.token_ids:
                t = now
                if delta.ttft_ms is not None:
                    t = submit_s + delta.ttft_ms / 1000.0
                    rec.first_token_s = t
                rec.last_token_s = t
                rec.num_tokens = delta.num_generated
            if delta.best_effort:
                rec.best_effort = True
            if delta.finish_reason is not None:
                rec.finish_reason = delta.finish_reason
                rec.finish_s = now
                rec.error = delta.error
                done.append(rid)
                break
    for rid in done:
        unit.active.pop(rid)[1].decode_steps = unit.target.steps.pop(rid, 0)


def _extras(units, settings, profile, duration_s, seed, wall_s, workload) -> dict[str, Any]:
    st = [u.target.stats for u in units]
    steps = sum(s.request_steps for s in st)
    iters = sum(s.iterations for s in st)
    batches = [b for s in st for b in s.batches]
    return {
        "mean_accepted": sum(s.emitted for s in st) / steps if steps else None,
        "mean_accepted_drafts": sum(s.accepted_drafts for s in st) / steps if steps else None,
        # tokens per step over steps that verified a draft (the live server's
        # adaserve_spec_decode_num_emitted_tokens_total / _num_drafts_total)
        "mean_emitted_per_draft": (
            sum(s.drafted_emitted for s in st) / drafted
            if (drafted := sum(s.drafted_steps for s in st))
            else None
        ),
        "draft_acceptance_rate": (
            sum(s.accepted_drafts for s in st) / max(1, sum(s.drafted_verified for s in st))
        ),
        "iterations": iters,
        "mean_batch": float(np.mean([b[0] for b in batches])) if batches else 0.0,
        "max_batch": max((b[0] for b in batches), default=0),
        "preemptions": sum(u.engine.preemptions for u in units),
        "mean_tree_tokens": float(np.mean([b[1] for b in batches])) if batches else 0.0,
        "max_tree_tokens": max((b[1] for b in batches), default=0),
        "budget": settings.scheduler.budget,
        "verify_ms_total": sum(s.verify_ms for s in st),
        "prefill_ms_total": sum(s.prefill_ms for s in st),
        "draft_ms_total": sum(u.drafter.draft_ms_total for u in units if u.drafter),
        "baseline_tpot_ms": profile.baseline_ms(),
        "profile": profile.name,
        "workload": workload.name,
        "units": len(units),
        "duration_s": duration_s,
        "seed": seed,
        "sim_wall_s": wall_s,
    }
