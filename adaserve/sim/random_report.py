"""The random sweep's report (`adaserve simulate --sweep random`,
adaserve/sim/random_sweep.py): the summary over workloads, the table with the class
where adaserve loses most per workload, and the plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def aggregate(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst ratios across workloads, and how many fall below cb-priority."""
    v = [r["violations_ratio"] for r in results]
    g = [r["goodput_ratio"] for r in results]
    below = [
        r["name"]
        for r in results
        if r.get("attainment_vs_cb_priority", 0.0) < 0.0
        or r.get("goodput_vs_cb_priority", 1.0) < 1.0
    ]
    out = {
        "workloads": len(results),
        "violations_ratio_median": float(np.median(v)),
        "violations_ratio_worst": float(min(v)),
        "goodput_ratio_median": float(np.median(g)),
        "goodput_ratio_worst": float(min(g)),
        "below_cb_priority": below,
        "wins": sum(x > 1.0 for x in v),
        "losses": sum(x < 1.0 for x in v),
    }
    chosen = [r["violations_ratio_chosen"] for r in results if "violations_ratio_chosen" in r]
    if chosen:
        out["chosen"] = {
            "violations_ratio_median": float(np.median(chosen)),
            "wins": sum(x > 1.0 for x in chosen),
            "losses": sum(x < 1.0 for x in chosen),
            "best_changed": sum(r["chosen_on_reused"] != r["best_baseline"] for r in results),
        }
    return out


def worst_class(result: dict[str, Any]) -> str:
    """Where adaserve loses to the best baseline on one workload: the class with the most
    requests the best baseline meets and adaserve misses, its share of the requests, and
    both policies' TTFT / TPOT attainment in it ("-" where adaserve misses no more)."""
    ours = result["policies"]["adaserve"].get("per_class") or {}
    best = result["policies"][result["best_baseline"]].get("per_class") or {}
    total = sum(c.get("requests") or 0 for c in ours.values())
    lost = {
        name: (best[name]["slo_attainment"] - c["slo_attainment"]) * (c.get("requests") or 0)
        for name, c in ours.items()
        if name in best and c.get("slo_attainment") is not None
    }
    if not lost or max(lost.values()) <= 0 or not total:
        return "-"
    name = max(lost, key=lambda k: lost[k])
    a, b = ours[name], best[name]
    return (
        f"{name} ({a['requests'] / total:.0%}): TTFT {_f(a.get('ttft_attainment'))} vs "
        f"{_f(b.get('ttft_attainment'))}, TPOT {_f(a.get('tpot_attainment'))} vs "
        f"{_f(b.get('tpot_attainment'))}"
    )


def markdown(results: Sequence[dict[str, Any]], header: str = "") -> str:
    agg = aggregate(results)
    lines = [header] if header else []
    lines += [
        f"{agg['workloads']} workloads. adaserve vs best baseline: violations ratio median "
        f"{agg['violations_ratio_median']:.2f}, worst {agg['violations_ratio_worst']:.2f} "
        f"(>1: adaserve misses fewer; wins {agg['wins']}, losses {agg['losses']}); goodput "
        f"ratio median {agg['goodput_ratio_median']:.2f}, worst "
        f"{agg['goodput_ratio_worst']:.2f}. Below cb-priority (attainment or goodput): "
        f"{len(agg['below_cb_priority'])}"
        + (f" ({', '.join(agg['below_cb_priority'])})" if agg["below_cb_priority"] else "")
        + "."
        + (
            f" On this fresh trace, against the baseline that was best on the reused one "
            f"(best here on {agg['workloads'] - agg['chosen']['best_changed']} of "
            f"{agg['workloads']}): violations ratio median "
            f"{agg['chosen']['violations_ratio_median']:.2f} (wins {agg['chosen']['wins']}, "
            f"losses {agg['chosen']['losses']})."
            if "chosen" in agg
            else ""
        ),
        "",
        "| workload | profile | req/s | best baseline | attainment adaserve / best / cb-priority "
        "| TTFT att. adaserve / cb-priority | violations ratio | goodput ratio "
        "| where adaserve loses most: class (share): adaserve vs best | workload |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["policies"]
        a, b = p["adaserve"], p[r["best_baseline"]]
        c = p.get("cb-priority", {})
        desc = r["description"].split("; ", 1)[1] if "; " in r["description"] else ""
        lines.append(
            f"| {r['name']} | {r['profile']} | {r['rps']:.3g} | {r['best_baseline']} | "
            f"{a['slo_attainment']:.3f} / {b['slo_attainment']:.3f} / "
            f"{_f(c.get('slo_attainment'))} | {_f(a.get('ttft_attainment'))} / "
            f"{_f(c.get('ttft_attainment'))} | {r['violations_ratio']:.2f} | "
            f"{r['goodput_ratio']:.2f} | {worst_class(r)} | {desc} |"
        )
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def plot(results: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per workload: violations ratio and goodput ratio vs the best baseline (bars, log
    scale) and adaserve's attainment minus cb-priority's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"].rsplit("-", 1)[-1] for r in results]
    x = np.arange(len(results))
    fig, axes = plt.subplots(3, 1, figsize=(max(6.0, 0.45 * len(results) + 2), 8), sharex=True)
    for ax, key, label in (
        (axes[0], "violations_ratio", "best baseline's violations / adaserve's (+1 each)"),
        (axes[1], "goodput_ratio", "adaserve goodput / best baseline's"),
    ):
        vals = np.array([r[key] for r in results])
        ax.bar(x, vals, color=["tab:green" if v >= 1.0 else "tab:red" for v in vals])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(label, fontsize=8)
    diff = np.array([r.get("attainment_vs_cb_priority", 0.0) for r in results])
    axes[2].bar(x, diff, color=["tab:green" if d >= 0 else "tab:red" for d in diff])
    axes[2].axhline(0.0, color="k", lw=0.8)
    axes[2].set_ylabel("attainment: adaserve - cb-priority", fontsize=8)
    axes[2].set_xticks(x, names, fontsize=7)
    axes[2].set_xlabel("workload (index; profile = index mod 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: Sequence[dict[str, Any]], out: Path, header: str = "") -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    js = out / "random_sweep.json"
    js.write_text(
        json.dumps({"summary": aggregate(results), "workloads": list(results)}, indent=1) + "\n"
    )
    md = out / "random_sweep.md"
    md.write_text(markdown(results, header))
    return [js, md, plot(results, out / "random_sweep.png")]
