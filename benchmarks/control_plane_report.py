"""Report of the control-plane benchmark: goal check, table and plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

GOAL_MS = 2.0


def goal_summary(rows: list[dict]) -> dict:
    grpc = {r["n"]: r for r in rows if r["mode"] == "grpc"}
    aio = {r["n"]: r for r in rows if r["mode"] == "all-in-one"}
    per_n = {
        str(n): {
            "added_p50_ms": grpc[n]["added_p50_ms"],
            "added_p90_ms": grpc[n]["added_p90_ms"],
            "added_p10_ms": grpc[n]["added_p10_ms"],
            "serde_cpu_p50_ms": grpc[n]["serde_cpu_p50_ms"],
            # cross-check from the two runs' medians (unpaired: different iterations)
            "control_p50_diff_ms": grpc[n]["control_p50_ms"] - aio[n]["control_p50_ms"],
            "goal_met": grpc[n]["added_p50_ms"] <= GOAL_MS,
        }
        for n in sorted(grpc)
        if n in aio
    }
    return {"goal_ms": GOAL_MS, "per_n": per_n}


def print_table(rows: list[dict], meta: dict, summary: dict) -> None:
    print(
        f"\nControl plane per iteration (ms, p50 / p90), d={meta['depth']} w={meta['width']} "
        f"B={meta['budget']}; {meta['cpus']} CPUs, load average {meta['loadavg_before'][0]:.1f} "
        f"before / {meta['loadavg_after'][0]:.1f} after"
    )
    cols = [
        ("n", 3),
        ("all-in-one select", 17),
        ("gRPC Select call", 16),
        ("Select RPC", 13),
        ("Speculate RPC", 13),
        ("Plan RPC", 13),
        ("added", 15),
        ("added p10", 9),
        ("of it CPU", 9),
        ("iteration aio / gRPC", 20),
        ("goal", 6),
    ]
    print("| " + " | ".join(f"{name:>{w}}" for name, w in cols) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w in cols) + "|")
    aio = {r["n"]: r for r in rows if r["mode"] == "all-in-one"}
    for g in (r for r in rows if r["mode"] == "grpc"):
        a = aio[g["n"]]

        def pp(r: dict, k: str) -> str:
            return f"{r[k + '_p50_ms']:.2f} / {r[k + '_p90_ms']:.2f}"

        cells = [
            str(g["n"]),
            pp(a, "select"),
            pp(g, "select"),
            pp(g, "select_rpc"),
            pp(g, "spec_rpc"),
            pp(g, "plan"),
            pp(g, "added"),
            f"{g['added_p10_ms']:.2f}",
            f"{g['serde_cpu_p50_ms']:.2f}",
            f"{a['step_p50_ms']:.0f} / {g['step_p50_ms']:.0f}",
            "met" if summary["per_n"][str(g["n"])]["goal_met"] else "MISSED",
        ]
        print("| " + " | ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols, strict=True)) + " |")
    print(
        "added = (Plan call - local plan) + (Select call - local select) + (Speculate call -"
        " server compute); of it CPU = engine-thread CPU in the calls + server (de)serialization"
        " (p50): the rest is transport and waiting for a CPU, which load inflates."
    )
    if any(r["errors"] for r in rows):
        print("WARNING: some control-plane calls failed (fallbacks); see results.json 'errors'")


def plot(rows: list[dict], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grpc = [r for r in rows if r["mode"] == "grpc"]
    aio = {r["n"]: r for r in rows if r["mode"] == "all-in-one"}
    x = np.arange(len(grpc))
    labels = [str(r["n"]) for r in grpc]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    bottom = np.zeros(len(grpc))
    for key, label in (
        ("plan", "Plan call"),
        ("select_rpc", "Select RPC (call - server compute)"),
        ("spec_rpc", "Speculate RPC (call - server compute)"),
    ):
        v = np.array([r[f"{key}_p50_ms"] for r in grpc])
        ax.bar(x, v, 0.5, bottom=bottom, label=label)
        bottom += v
    for q, marker in ((10, "k^"), (50, "ko"), (90, "kv")):
        ax.plot(x, [r[f"added_p{q}_ms"] for r in grpc], marker, label=f"added p{q}")
    ax.axhline(GOAL_MS, color="red", lw=0.8, ls=":", label=f"goal {GOAL_MS} ms")
    ax.set_xticks(x, labels)
    ax.set_xlabel("concurrent requests n")
    ax.set_ylabel("ms per iteration")
    ax.set_title("gRPC overhead by call (p50 parts)")
    ax.legend(fontsize=7)
    ax = axes[1]
    cpu = np.array([r["serde_cpu_p50_ms"] for r in grpc])
    wait = np.array([r["wait_p50_ms"] for r in grpc])
    ax.bar(x, cpu, 0.5, label="CPU: client call path + server (de)serialization")
    ax.bar(x, wait, 0.5, bottom=cpu, label="transport + waiting for a CPU")
    ax.bar(x + 0.3, [aio[r["n"]]["select_p50_ms"] for r in grpc], 0.15, label="all-in-one select")
    ax.axhline(GOAL_MS, color="red", lw=0.8, ls=":", label=f"goal {GOAL_MS} ms")
    ax.set_xticks(x, labels)
    ax.set_xlabel("concurrent requests n")
    ax.set_title("RPC time: work vs waiting (p50)")
    ax.legend(fontsize=7)
    fig.suptitle(
        f"adaserve control plane, d={meta['depth']} w={meta['width']} B={meta['budget']}, "
        f"{meta['cpus']} CPUs, load {meta['loadavg_before'][0]:.1f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
