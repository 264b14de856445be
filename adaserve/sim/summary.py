"""The papers' metrics over per-request records, shared by the simulator and `bench serve`.

A request attains its SLO when it meets both: its TTFT SLO, where it has one
(t_first - arrival <= ttft_slo), and its TPOT SLO, (t_last - t_first) / (n_tokens - 1)
<= tpot_slo (a single-token output meets it when it finishes normally); each is also
reported on its own (ttft_attainment, tpot_attainment). Goodput is the tokens per
second of requests that attained, over the span from the first arrival to the last
finish. Requests that never finished (rejected, error, timeout) count as violations.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

OK_FINISH = ("stop", "length")


@dataclass
class RequestRecord:
    id: str
    slo_class: str
    tpot_slo_ms: float
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    unit: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    finish_s: float | None = None
    best_effort: bool = False
    error: str | None = None
    decode_steps: int | None = None  # verification steps (simulator only)
    ttft_slo_ms: float | None = None  # None: no TTFT SLO

    @property
    def tpot_ms(self) -> float | None:
        if self.first_token_s is None or self.last_token_s is None or self.num_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) * 1000.0 / (self.num_tokens - 1)

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.arrival_s) * 1000.0

    @property
    def tpot_attained(self) -> bool:
        if self.finish_reason not in OK_FINISH or self.num_tokens < 1:
            return False
        tpot = self.tpot_ms
        return True if tpot is None else tpot <= self.tpot_slo_ms

    @property
    def ttft_attained(self) -> bool:
        if self.finish_reason not in OK_FINISH or self.num_tokens < 1:
            return False
        ttft = self.ttft_ms
        return self.ttft_slo_ms is None or (ttft is not None and ttft <= self.ttft_slo_ms)

    @property
    def attained(self) -> bool:
        return self.ttft_attained and self.tpot_attained

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tpot_ms=self.tpot_ms, ttft_ms=self.ttft_ms, attained=self.attained)
        return d


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _group(records: list[RequestRecord], span_s: float) -> dict[str, Any]:
    n = len(records)
    attained = [r for r in records if r.attained]
    tpots = [t for r in records if (t := r.tpot_ms) is not None]
    steps = sum(r.decode_steps or 0 for r in records)
    ttfts = [t for r in records if (t := r.ttft_ms) is not None]
    return {
        "requests": n,
        "finished": sum(r.finish_reason in OK_FINISH for r in records),
        "attained": len(attained),
        "slo_attainment": len(attained) / n if n else None,
        "ttft_attainment": sum(r.ttft_attained for r in records) / n if n else None,
        "tpot_attainment": sum(r.tpot_attained for r in records) / n if n else None,
        "goodput": sum(r.num_tokens for r in attained) / span_s if span_s > 0 else 0.0,
        "throughput": sum(r.num_tokens for r in records) / span_s if span_s > 0 else 0.0,
        "tpot_p50_ms": _pct(tpots, 50),
        "tpot_p90_ms": _pct(tpots, 90),
        "tpot_p99_ms": _pct(tpots, 99),
        "ttft_p50_ms": _pct(ttfts, 50),
        "ttft_p90_ms": _pct(ttfts, 90),
        "ttft_p99_ms": _pct(ttfts, 99),
        "tpot_slo_ms": records[0].tpot_slo_ms if n and _same_slo(records) else None,
        "ttft_slo_ms": records[0].ttft_slo_ms if n and _same_ttft(records) else None,
        # tokens per verification step (bonus included), when steps were recorded
        "mean_accepted": (
            sum(r.num_tokens - 1 for r in records if r.decode_steps) / steps if steps else None
        ),
    }


def _same_ttft(records: list[RequestRecord]) -> bool:
    return all(r.ttft_slo_ms == records[0].ttft_slo_ms for r in records)


def _same_slo(records: list[RequestRecord]) -> bool:
    return all(math.isclose(r.tpot_slo_ms, records[0].tpot_slo_ms) for r in records)


def summarize(
    records: Iterable[RequestRecord], policy: str, rps: float, **extra: Any
) -> dict[str, Any]:
    """`summary.json`: policy, rps, slo_attainment, goodput, per_class{...}, plus extras
    (mean_accepted and the simulator's or benchmark's own fields)."""
    records = list(records)
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.finish_s for r in records if r.finish_s is not None), default=start)
    span = end - start
    overall = _group(records, span)
    classes = sorted({r.slo_class for r in records})
    per_class = {c: _group([r for r in records if r.slo_class == c], span) for c in classes}
    out: dict[str, Any] = {"policy": policy, "rps": rps, **overall, "span_s": span}
    out["violations"] = overall["requests"] - overall["attained"]
    out["per_class"] = per_class
    out.setdefault("mean_accepted", None)
    out.update(extra)
    return out
