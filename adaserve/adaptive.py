"""Speculation depth and width from the number of active requests.

- `eurosys` (paper 001, eq. 8-9):
      d = clip(floor(B1 / (n + c1)) - 1, D_min, D_max)
      w = clip(floor(B2 / n) + c2, 1, W_max)
  B1 (verifier tokens per step) and B2 (drafter tokens per step) default to the
  scheduler budget B.
- `v1` (paper 000, eq. 8-9): d = max(1, min(D_max, ceil(B / n))),
  w = max(1, min(W_max, floor(B / n))).
- `fixed`: (fixed_depth, fixed_width) whatever the load.

With no active requests there is nothing to speculate for; every policy then answers
as it would for a single request, so the first request of an idle server is planned
for the lightest load.
"""

from __future__ import annotations

from adaserve.config import AdaptiveSettings


def plan_depth_width(n: int, budget: int, settings: AdaptiveSettings) -> tuple[int, int]:
    """(depth, width) >= (1, 1) for n active requests and a verifier budget B."""
    if n < 0:
        raise ValueError(f"n: number of active requests must be >= 0, got {n}")
    if budget < 1:
        raise ValueError(f"budget: must be a positive integer, got {budget}")
    n = max(n, 1)
    s = settings
    if s.policy == "fixed":
        return s.fixed_depth, s.fixed_width
    if s.policy == "v1":
        depth = max(1, min(s.d_max, -(-budget // n)))
        width = max(1, min(s.w_max, budget // n))
        return depth, width
    b1 = s.b1 if s.b1 is not None else budget
    b2 = s.b2 if s.b2 is not None else budget
    # n + c1 <= 0 would divide by zero or flip the sign: treat it as the deepest plan.
    depth = b1 // (n + s.c1) - 1 if n + s.c1 > 0 else s.d_max
    depth = _clip(depth, s.d_min, max(s.d_min, s.d_max))
    width = _clip(b2 // n + s.c2, 1, s.w_max)
    return depth, width


def _clip(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))
