"""Fault injection for reliability tests and drills: off unless its variable is set.

Each knob is an environment variable read once when a service starts, so a test (or an
operator rehearsing an incident) can make one process misbehave without a code path
that production configuration could switch on by accident.

- `ADASERVE_FAULT_DRAFTER_DELAY_MS`: the drafter service sleeps this long before
  every Speculate, as an overloaded or throttled drafter would. The engine must not
  wait past `engine.speculation_timeout_ms`; it decodes without speculation instead.
"""

from __future__ import annotations

import math
import os

DRAFTER_DELAY_ENV = "ADASERVE_FAULT_DRAFTER_DELAY_MS"


def delay_s(env: str) -> float:
    """The delay named by `env` in seconds (0 when unset); ValueError on nonsense, so a
    typo fails the service at start-up instead of silently injecting nothing."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms >= 0):
        raise ValueError(f"{env} must be a number of milliseconds >= 0, got {raw!r}")
    return ms / 1000.0
