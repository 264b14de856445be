"""How many tokens each request must get accepted this iteration to stay on its SLO.

A request that has decoded o_r tokens in l_r ms since its first decoding step meets a
TPOT SLO t_r after this iteration (which takes t_spec ms) when
(l_r + t_spec) / (o_r + accepted) <= t_r, i.e. accepted >= A(r) with

    A(r) = (l_r + t_spec) / t_r - o_r                       (paper 000, section 3)

A tree of depth d can yield at most d + 1 tokens (d drafted plus the bonus token), so
selection aims at A_cap(r) = min(A(r), d + 1). A(r) <= 1 means the bonus token alone
keeps the request on track.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def required_accepted(
    elapsed_ms: np.ndarray, decoded: np.ndarray, tpot_slo_ms: np.ndarray, t_spec_ms: float
) -> np.ndarray:
    """A(r) for every request: float64 [n]."""
    elapsed = np.asarray(elapsed_ms, dtype=np.float64)
    return (elapsed + t_spec_ms) / np.asarray(tpot_slo_ms, dtype=np.float64) - np.asarray(
        decoded, dtype=np.float64
    )


def capped(a: np.ndarray, depth: int) -> np.ndarray:
    """A_cap(r) = min(A(r), d + 1): float64 [n]."""
    return np.minimum(np.asarray(a, dtype=np.float64), float(depth + 1))


def slo_targets(
    elapsed_ms: np.ndarray,
    decoded: np.ndarray,
    tpot_slo_ms: np.ndarray,
    t_spec_ms: float,
    depth: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(A, A_cap), both float64 [n]."""
    a = required_accepted(elapsed_ms, decoded, tpot_slo_ms, t_spec_ms)
    return a, capped(a, depth)


@dataclass(frozen=True)
class SLOVerdict:
    """Admission's judgement of a request's TPOT SLO, made when it is submitted (before
    any token), so the first message of its stream can carry it."""

    best_effort: bool  # below the floor: served, but the SLO is not expected to hold
    floor_ms: float  # the best TPOT one request alone can expect (adaptive.slo_floor)
    reason: str | None = None  # why it is best-effort, for the response


def judge(tpot_slo_ms: float, floor_ms: float, floor_depth: int) -> SLOVerdict:
    """Best-effort exactly when the SLO is below the floor."""
    if tpot_slo_ms >= floor_ms:
        return SLOVerdict(False, floor_ms)
    how = f"draft depth {floor_depth}" if floor_depth else "plain decoding"
    return SLOVerdict(
        True,
        floor_ms,
        f"tpot_slo_ms {tpot_slo_ms:g} is below this server's floor of {floor_ms:g} ms "
        f"per token, the best one request alone can expect ({how})",
    )


def describe(
    baseline_tpot_ms: float, classes_ms: dict[str, float], default_class: str, floor_ms: float
) -> str:
    """One line for logs and consoles: what the baseline came out as and what each SLO
    class resolved to, e.g. `baseline TPOT 27.1 ms; SLO classes coding 32.5 ms, chat 54.1
    ms (default), summarize 108.2 ms; floor 21.2 ms`."""
    parts = [
        f"{name} {ms:.1f} ms" + (" (default)" if name == default_class else "")
        for name, ms in sorted(classes_ms.items(), key=lambda kv: (kv[1], kv[0]))
    ]
    return (
        f"baseline TPOT {baseline_tpot_ms:.1f} ms; SLO classes {', '.join(parts) or 'none'}; "
        f"floor {floor_ms:.1f} ms"
    )
