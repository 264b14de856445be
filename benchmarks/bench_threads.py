"""Why every service does its torch work on one thread (adaserve/torch_thread.py).

Times a target forward (1, 3 and 9 chain tokens over 60 cached ones, median of 15) in a
fresh process per case, since OpenMP teams outlive the work that created them:

- `one-thread`: load and compute on one thread (what the services do);
- `two-threads`: load and warm up on the main thread, compute on another (the old way);
- `passive`: one thread, OMP_WAIT_POLICY=PASSIVE (every op wakes a sleeping worker).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_threads.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

CASES = {
    "one-thread": {},
    "two-threads": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def child(case: str) -> None:
    import numpy as np

    from adaserve.model.loader import load_runner
    from adaserve.model.runner import SeqInput

    def load():
        runner = load_runner("embedded", "cpu", "float32")
        rng = np.random.default_rng(0)
        runner.add_sequence("a")
        toks = rng.integers(1000, 20000, size=60, dtype=np.int32)
        runner.forward([SeqInput.chain("a", toks)], logits_indices=[59])
        runner.commit("a", range(60))
        return runner, rng

    def measure(runner, rng) -> list[float]:
        out = []
        for n in (1, 3, 9):
            times = []
            for _ in range(15):
                t = rng.integers(1000, 20000, size=n, dtype=np.int32)
                t0 = time.perf_counter()
                runner.forward([SeqInput("a", t, np.arange(-1, n - 1, dtype=np.int32))])
                times.append((time.perf_counter() - t0) * 1000)
                runner.commit("a", [])
            out.append(statistics.median(times))
        return out

    result: list[float] = []
    if case == "two-threads":
        runner, rng = load()  # main thread
        th = threading.Thread(target=lambda: result.extend(measure(runner, rng)))
    else:

        def both() -> None:
            result.extend(measure(*load()))

        th = threading.Thread(target=both)
    th.start()
    th.join()
    print(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="cases alternate this many times")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    results: dict[str, list[list[float]]] = {c: [] for c in CASES}
    for _ in range(args.rounds):
        for case, extra in CASES.items():
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",)}
            env.update(extra)
            out = subprocess.run(
                [sys.executable, __file__, "--child", case],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[case].append(json.loads(out.strip().splitlines()[-1]))
    print("case          forward ms at 1 / 3 / 9 tokens (median over rounds)")
    for case, rows in results.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"{case:12s}  " + " / ".join(f"{m:6.1f}" for m in med))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
