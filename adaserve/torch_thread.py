"""One OS thread for all of a process's torch work.

libgomp (the OpenMP runtime of the CPU torch wheels) spins briefly between parallel
regions, so a forward's hundreds of small ops hand work to their threads without a
futex wake-up each. It cuts that spin to ~100 iterations as soon as the process holds
more OpenMP threads than CPUs, which happens the moment a second OS thread runs a
parallel region: each thread that does gets its own team. A service that loads its
model on the main thread and computes on a worker thread therefore pays a wake-up per
op. On the 2-core CI host a 1-token SmolLM2 forward takes 45 ms when one thread does all
the torch work and 109 ms when the model was loaded on another
(`benchmarks/bench_threads.py`, `BENCHMARKS.md`).

So the verifier and drafter services load, warm up and compute on one executor thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def torch_thread(name: str) -> ThreadPoolExecutor:
    """A single-worker executor: everything submitted to it runs on the same OS thread
    (a ThreadPoolExecutor keeps its one worker alive between tasks)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
