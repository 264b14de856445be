"""PNG plots of sweeps and of one run's latency distributions (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from adaserve.sim.summary import RequestRecord

X_LABELS = {
    "rps": "request rate (req/s)",
    "urgent": "proportion of urgent requests",
    "slo-scale": "urgent SLO / baseline latency",
}


def plot_sweep(rows: Sequence[dict[str, Any]], kind: str, out_dir: Path) -> list[Path]:
    """`sweep_<kind>_attainment.png`, `_goodput.png` and `_per_class.png`: one line per
    policy (rows as written by sweep.flatten / read back from the CSV)."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    classes = sorted(
        {
            k[: -len("_slo_attainment")]
            for r in rows
            for k in r
            if k.endswith("_slo_attainment") and k != "slo_attainment"
        }
    )
    xlabel = X_LABELS.get(kind, kind)
    paths = []
    for metric, ylabel, name in (
        ("slo_attainment", "SLO attainment", "attainment"),
        ("goodput", "goodput (tokens/s)", "goodput"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for p in policies:
            xs, ys = _series(rows, p, metric)
            ax.plot(xs, ys, marker="o", label=p)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if metric == "slo_attainment":
            ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"sweep_{kind.replace('-', '_')}_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    if classes:
        fig, axes = plt.subplots(1, len(classes), figsize=(4 * len(classes), 3.5), squeeze=False)
        for ax, c in zip(axes[0], classes, strict=True):
            for p in policies:
                xs, ys = _series(rows, p, f"{c}_slo_attainment")
                ax.plot(xs, ys, marker=".", label=p)
            ax.set_title(c)
            ax.set_xlabel(xlabel)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("SLO attainment")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"sweep_{kind.replace('-', '_')}_per_class.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _series(rows, policy: str, metric: str) -> tuple[list[float], list[float]]:
    pts = sorted(
        (float(r["x"]), float(r[metric]))
        for r in rows
        if r["policy"] == policy and r.get(metric) is not None
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_latency(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    """TPOT CDF per class (dashed: the class's SLO) and TTFT CDF per class."""
    classes = sorted({r.slo_class for r in records})
    fig, (ax_tpot, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for i, c in enumerate(classes):
        color = f"C{i}"
        rs = [r for r in records if r.slo_class == c]
        tpot = np.sort([t for r in rs if (t := r.tpot_ms) is not None])
        ttft = np.sort([t for r in rs if (t := r.ttft_ms) is not None])
        if tpot.size:
            ax_tpot.plot(tpot, np.arange(1, tpot.size + 1) / tpot.size, color=color, label=c)
            ax_tpot.axvline(rs[0].tpot_slo_ms, color=color, linestyle="--", alpha=0.6)
        if ttft.size:
            ax_ttft.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, color=color, label=c)
    ax_tpot.set_xlabel("TPOT (ms)  [dashed: SLO]")
    ax_ttft.set_xlabel("TTFT (ms)")
    for ax in (ax_tpot, ax_ttft):
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
