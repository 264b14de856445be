"""Headline numbers from sweep CSVs: AdaServe against the best baseline at each point.

    python benchmarks/sim/headline.py OUT/sweep_rps.csv [more.csv ...]

Baselines are the non-AdaServe systems of paper 001 (spec-K ~ vLLM-Spec(K), specinfer,
cb ~ vLLM / Sarathi-Serve decode, cb-priority); `equal` and `global` are ablations of
AdaServe itself and are not baselines. For each point: the best baseline by attainment,
the violation ratio (1 - att_best) / (1 - att_adaserve) (paper: "up to 4.3x fewer
violations") and the goodput ratio against the best baseline by goodput ("1.9x").
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from adaserve.sim.sweep import read_csv

ABLATIONS = ("adaserve", "equal", "global")


def headline(path: Path) -> str:
    rows = read_csv(path)
    xs = sorted({r["x"] for r in rows})
    lines = [
        f"### {path.parent.name}/{path.name}",
        "",
        "| x | adaserve att | best baseline (att) | violations ratio | adaserve goodput "
        "| best baseline (goodput) | goodput ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in xs:
        at = {r["policy"]: r for r in rows if r["x"] == x}
        ada = at.get("adaserve")
        base = [r for p, r in at.items() if p not in ABLATIONS]
        if ada is None or not base:
            continue
        b_att = max(base, key=lambda r: r["slo_attainment"])
        b_good = max(base, key=lambda r: r["goodput"])
        viol_a = 1.0 - ada["slo_attainment"]
        viol_b = 1.0 - b_att["slo_attainment"]
        vr = viol_b / viol_a if viol_a > 0 else float("inf")
        gr = ada["goodput"] / b_good["goodput"] if b_good["goodput"] else float("inf")
        lines.append(
            f"| {x:g} | {ada['slo_attainment']:.3f} | {b_att['policy']} "
            f"({b_att['slo_attainment']:.3f}) | {vr:.2f}x | {ada['goodput']:.0f} | "
            f"{b_good['policy']} ({b_good['goodput']:.0f}) | {gr:.2f}x |"
        )
    return "\n".join(lines)


def table(path: Path, metric: str) -> str:
    rows = read_csv(path)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    xs = sorted({r["x"] for r in rows})
    out = [f"| {metric} | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for x in xs:
        cells = []
        for p in policies:
            v = next((r[metric] for r in rows if r["x"] == x and r["policy"] == p), None)
            cells.append("-" if v is None else (f"{v:.3f}" if v <= 1.0 else f"{v:.0f}"))
        out.append(f"| {x:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        p = Path(arg)
        print(headline(p))
        print()
        print(table(p, "slo_attainment"))
        print()
        print(table(p, "goodput"))
        print()
