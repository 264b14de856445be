"""The simulator's multi-unit driver routed by the gateway's own code, and capacity
planning on top of it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adaserve import routing
from adaserve.sim import driver
from adaserve.sim.capacity import plan_units
from adaserve.sim.driver import simulate
from tests._serving import REPO
from tests._sim import small_workload

RPS = 40.0  # more than one unit of the capacity workload serves at its SLOs


def capacity_workload():
    """The small workload with TTFT SLOs (the EuroSys workload's): since one forward
    carries prefill beside the decoding streams, an overloaded unit keeps its TPOT SLOs
    and the overload shows as queueing before the first token."""
    data = small_workload(duration_s=6.0).model_dump(mode="json", exclude_none=True)
    for name, ttft_ms in (("coding", 1000), ("chat", 1000), ("summarization", 3000)):
        data["classes"][name]["slo"]["ttft_ms"] = ttft_ms
    return type(small_workload())(**data)


def test_the_driver_routes_with_the_gateways_code(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    real = routing.route

    def spy(req, cands, params):
        decision = real(req, cands, params)
        calls.append((params.policy, len(cands)))
        # The driver reads every unit's load as a report without delay.
        assert all(c.load is not None and c.load_age_s == 0.0 for c in cands)
        return decision

    monkeypatch.setattr(driver, "route", spy)
    wl = small_workload(units=3, rps=6.0)
    res = simulate(wl, "adaserve")
    assert res.summary["routing"] == "slo"  # the gateway's default (fleet.routing)
    assert calls and calls == [("slo", 3)] * len(res.records)
    assert {r.unit for r in res.records} == {0, 1, 2}


def test_routing_choices_keep_every_request_and_stay_deterministic() -> None:
    wl = small_workload(units=2, rps=6.0)
    out = {}
    for policy in routing.POLICIES:
        a, b = simulate(wl, "adaserve", routing=policy), simulate(wl, "adaserve", routing=policy)
        assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]
        assert all(r.finish_reason == "length" for r in a.records)
        out[policy] = [r.unit for r in a.records]
    assert out["slo"] != out["least_outstanding"]  # the policies do decide differently
    with pytest.raises(ValueError, match="routing must be one of"):
        simulate(wl, "adaserve", routing="random")


def test_prefix_affinity_sends_a_shared_prefix_to_the_unit_that_holds_it() -> None:
    """Prompts of one class share their first 192 tokens (three token blocks): routed by
    prefix, they gather on the unit that served the first (while its SLOs allow and it
    runs at most routing.imbalance more than the least loaded unit), where the prefix
    cache serves them: less prefill work in all than spread by least outstanding."""
    wl = small_workload(units=3, rps=2.0)
    classes = {
        name: c.model_copy(update={"shared_prefix_tokens": 192, "weight": 1.0})
        for name, c in wl.classes.items()
        if name == "summarization"
    }
    wl = wl.model_copy(update={"classes": classes})
    res = simulate(wl, "adaserve", routing="slo")
    units = [r.unit for r in res.records]
    share = max(units.count(u) for u in set(units)) / len(units)
    lo = simulate(wl, "adaserve", routing="least_outstanding")
    lo_units = [r.unit for r in lo.records]
    lo_share = max(lo_units.count(u) for u in set(lo_units)) / len(lo_units)
    assert share >= 0.6 and share > lo_share + 0.2, (units, lo_units)
    assert res.summary["prefill_ms_total"] < lo.summary["prefill_ms_total"]
    assert res.summary["slo_attainment"] >= lo.summary["slo_attainment"]


def test_capacity_finds_the_fewest_units_that_attain_the_target() -> None:
    wl = capacity_workload()
    seen: list[int] = []
    plan = plan_units(
        wl, "adaserve", RPS, 0.9, max_units=8, progress=lambda p: seen.append(p.units)
    )
    assert plan.units is not None and 1 <= plan.units <= 8
    by_units = {p.units: p for p in plan.points}
    assert by_units[plan.units].attainment >= 0.9
    if plan.units > 1:
        assert by_units[plan.units - 1].attainment < 0.9  # bisected down to the edge
    assert sorted(seen) == [p.units for p in plan.points]  # each count simulated once
    assert plan.units > 1, "pick a load one unit cannot serve, or this proves little"
    short = plan_units(wl, "adaserve", RPS, 0.9, max_units=plan.units - 1)
    assert short.units is None and max(p.units for p in short.points) == plan.units - 1
    with pytest.raises(ValueError, match="target"):
        plan_units(wl, "adaserve", RPS, 1.5)


def test_capacity_command(tmp_path) -> None:
    wl = capacity_workload()
    path = tmp_path / "wl.yaml"
    path.write_text(json.dumps(wl.model_dump(mode="json", exclude_none=True)))
    out = tmp_path / "plan.json"
    r = subprocess.run(
        [
            *(sys.executable, "-m", "adaserve.cli", "capacity", str(path), "--rps", str(RPS)),
            *("--target", "0.9", "--duration", "6", "--max-units", "8", "--out", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert f"units needed: {plan['units']}" in r.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "adaserve.cli",
            "capacity",
            str(path),
            "--rps",
            "12",
            "--target",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "target attainment must be in (0, 1]" in bad.stderr


def test_simulate_command_takes_units_and_routing(tmp_path) -> None:
    wl = small_workload(duration_s=4.0)
    path = tmp_path / "wl.yaml"
    path.write_text(json.dumps(wl.model_dump(mode="json", exclude_none=True)))
    base = [sys.executable, "-m", "adaserve.cli", "simulate", str(path), "--policy", "adaserve"]
    out = tmp_path / "run"
    r = subprocess.run(
        [*base, "--units", "3", "--routing", "least_outstanding", "--out", str(out), "--no-plots"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["units"] == 3 and summary["routing"] == "least_outstanding"
    bad = subprocess.run(
        [*base, "--units", "0", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--units must be >= 1" in bad.stderr
