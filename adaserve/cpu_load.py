"""Is the CPU oversubscribed? Checked once at startup by the verifier and `adaserve up`.

On a CPU, adaserve's step time is its torch threads' share of the cores. Another busy
process, or more torch threads than cores, slows every forward several times over (a
saturated 2-core host served 20-40x slower), and the verifier's startup baseline
(`slo.baseline_tpot_ms: auto`) is then measured slow too, so every SLO class comes out
loose. Nothing else says so: these checks print what they see and what to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Warn when the load average over the last minute already fills this share of the
# usable cores: from there a forward waits for a core about as often as it runs.
BUSY_SHARE = 0.5


@dataclass(frozen=True)
class CpuState:
    cores: int  # CPUs this process may run on (its affinity mask)
    load_1m: float  # runnable threads, averaged over the last minute (whole machine)
    torch_threads: int  # torch threads per process (OMP_NUM_THREADS, else one per core)


def current(torch_threads: int | None = None) -> CpuState:
    """This machine now. `torch_threads` defaults to what a torch process started from
    this environment uses (OMP_NUM_THREADS, else one per usable core), read without
    importing torch."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    if torch_threads is None:
        try:
            torch_threads = int(os.environ.get("OMP_NUM_THREADS", "")) or cores
        except ValueError:
            torch_threads = cores
    return CpuState(cores, load, torch_threads)


def busy(state: CpuState) -> bool:
    """The load average already fills BUSY_SHARE of the usable cores: a forward waits
    for a core about as often as it runs, and a timing taken now reads slow."""
    return state.load_1m >= BUSY_SHARE * state.cores


def oversubscription(state: CpuState, computing_processes: int = 1) -> list[str]:
    """Warnings (empty when the CPU looks free) for `computing_processes` torch
    processes that compute at the same time (verifier units x TP ranks; a drafter
    waits while its verifier computes and does not count) on `state`."""
    out = []
    if busy(state):
        out.append(
            f"the CPU is already busy: load average {state.load_1m:.1f} over the last "
            f"minute on {state.cores} usable core(s). Every forward shares them (20-40x "
            "slower seen on a saturated host), and a baseline measured now makes every "
            "SLO class loose. Stop other work, or give adaserve cores of its own "
            "(taskset -c / a cpuset) and set OMP_NUM_THREADS to their number."
        )
    threads = computing_processes * state.torch_threads
    if threads > state.cores:
        per = max(1, state.cores // max(computing_processes, 1))
        out.append(
            f"{computing_processes} torch process(es) computing at once x "
            f"{state.torch_threads} thread(s) each = {threads} threads on {state.cores} "
            f"core(s): oversubscribed threads are several times slower. Set "
            f"OMP_NUM_THREADS={per}."
        )
    return out
