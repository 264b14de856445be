"""Routing across real serving units: least outstanding requests against SLO-aware
routing, on the same units, side by side in one run.

    .venv/bin/python benchmarks/bench_routing.py --units 2 --rps 1.5 --duration 60 \\
        --seeds 0 1 --out out/bench-routing

`adaserve up --verifier-units U` (SLO-aware routing, the default) plus a second gateway
on the same units with `fleet.routing: least_outstanding`, so both routings see the
same units, the same measured baseline and so the same SLOs. Each seed's `adaserve demo`
workload runs through one gateway, then the other (the order alternates between seeds,
so a drift in this host's speed does not favour one routing); the units are idle
between runs. Prints one row per (seed, routing) and the means; writes every summary
and the gateways' routing decisions under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _server import free_port, start_up, stop_up

ROUTINGS = ("least_outstanding", "slo")
CLASSES = ("coding", "chat", "summarize")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _wait_ready(url: str, proc: subprocess.Popen, units: int, timeout_s: float = 120.0) -> None:
    """Until `url`/ready lists `units` healthy units with a load report each."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}")
        try:
            ready = json.loads(_get(f"{url}/ready"))
            if sum(1 for u in ready["units"] if u["healthy"] and u["load"]) == units:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready with {units} reporting units")


def _idle(url: str, timeout_s: float = 120.0) -> None:
    """Until no unit runs or queues anything (a previous run's stragglers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        units = json.loads(_get(f"{url}/ready"))["units"]
        if all(u["load"] and u["load"]["running"] + u["load"]["waiting"] == 0 for u in units):
            return
        time.sleep(1.0)


def _decisions(url: str) -> dict[str, float]:
    """adaserve_gateway_routing_decisions_total by reason."""
    out: dict[str, float] = {}
    for line in _get(f"{url}/metrics").splitlines():
        if line.startswith("adaserve_gateway_routing_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _demo(url: str, args: argparse.Namespace, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "adaserve", "demo", "--url", url, "--rps", str(args.rps)]
    cmd += ["--duration", str(args.duration), "--seed", str(seed), "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.duration * 4 + 120)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=2)
    p.add_argument("--rps", type=float, default=1.5)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--config", default="configs/embedded-cpu.yaml")
    p.add_argument("--out", type=Path, default=Path("out/bench-routing"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # Every torch process on one thread: U verifiers and U drafters share the cores.
    env = {"OMP_NUM_THREADS": "1"}
    port = free_port()
    up = start_up(
        ["--verifier-units", str(args.units), "--config", args.config],
        port,
        args.out / "up.log",
        env=env,
    )
    gw = None
    try:
        urls = {"slo": f"http://127.0.0.1:{port}"}
        _wait_ready(urls["slo"], up, args.units)
        addresses = [u["address"] for u in json.loads(_get(f"{urls['slo']}/ready"))["units"]]
        lo_port = free_port()
        gw_cmd = [sys.executable, "-m", "adaserve", "gateway", "--host", "127.0.0.1"]
        gw_cmd += ["--port", str(lo_port), "--grpc-port", "-1", "--config", args.config]
        for a in addresses:
            gw_cmd += ["--verifier", a]
        gw = subprocess.Popen(
            gw_cmd,
            stdout=(args.out / "gateway-least_outstanding.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env, "ADASERVE_FLEET__ROUTING": "least_outstanding"},
        )
        urls["least_outstanding"] = f"http://127.0.0.1:{lo_port}"
        _wait_ready(urls["least_outstanding"], gw, args.units)
        slo = json.loads(_get(f"{urls['slo']}/v1/slo"))
        (args.out / "slo.json").write_text(json.dumps(slo, indent=2))
        rows = []
        for i, seed in enumerate(args.seeds):
            for routing in ROUTINGS if i % 2 == 0 else ROUTINGS[::-1]:
                _idle(urls["slo"])
                before = _decisions(urls[routing])
                s = _demo(urls[routing], args, seed, args.out / f"{routing}-s{seed}")
                after = _decisions(urls[routing])
                why = {
                    k: after[k] - before.get(k, 0.0) for k in after if after[k] > before.get(k, 0)
                }
                rows.append({"seed": seed, "routing": routing, "summary": s, "decisions": why})
                print(_row(rows[-1]), flush=True)
        (args.out / "runs.json").write_text(json.dumps(rows, indent=2))
        print("\nmeans over seeds:")
        for routing in ROUTINGS:
            mine = [r for r in rows if r["routing"] == routing]
            att = sum(r["summary"]["slo_attainment"] for r in mine) / len(mine)
            good = sum(r["summary"]["goodput"] for r in mine) / len(mine)
            print(f"  {routing:<18} attainment {att:.3f}  goodput {good:.1f} tok/s")
    finally:
        if gw is not None:
            gw.terminate()
            gw.wait(timeout=30)
        stop_up(up)


def _row(r: dict) -> str:
    s = r["summary"]
    per = " ".join(
        f"{s['per_class'][c]['slo_attainment']:.2f}" if c in s["per_class"] else "-"
        for c in CLASSES
    )
    why = ",".join(f"{k}={v:.0f}" for k, v in sorted(r["decisions"].items()))
    return (
        f"seed {r['seed']} {r['routing']:<18} attainment {s['slo_attainment']:.3f} "
        f"({per})  goodput {s['goodput']:.1f} tok/s  requests {s['requests']}  [{why}]"
    )


if __name__ == "__main__":
    main()
