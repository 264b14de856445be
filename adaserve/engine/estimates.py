"""What the engine learns about its own costs as it runs, each an exponentially weighted
mean of what iterations measured: the decode iteration's latency per tree-token bucket
(`TSpecPredictor`), the drafters' time, and what requests actually waited per token."""

from __future__ import annotations

from dataclasses import dataclass, field

from adaserve.latency import BucketedEWMA, ewma

# Weight of each new observation of the drafters' costs.
ALPHA = 0.3
# Weight of each new TPOT observation: ~10 iterations, so it follows load within a
# second, not each iteration's noise.
TPOT_ALPHA = 0.1


@dataclass
class TSpecPredictor:
    """Predicts a decode iteration's latency (drafting included) from its tree tokens:
    an EWMA of measured iterations per token count, seeded from the profile and
    inflated by the correction factor."""

    initial_ms: float
    correction: float
    _ms: BucketedEWMA = field(default_factory=BucketedEWMA)

    def predict_ms(self, num_tokens: int) -> float:
        return self.measured_ms(num_tokens) * self.correction

    def measured_ms(self, num_tokens: int) -> float:
        """The EWMA itself, before the correction factor (selection_params applies it)."""
        return self._ms.get(num_tokens, self.initial_ms)

    def observe(self, num_tokens: int, ms: float) -> None:
        self._ms.observe(num_tokens, ms)


@dataclass
class Costs:
    """The drafters' costs and the TPOT requests saw, as the planner and `auto` read
    them (ms unless named otherwise)."""

    draft_ms: float = 0.0  # a drafting iteration's speculate phase
    model_draft_ms: float = 0.0  # the model drafter's call where it drafted
    # The n-gram drafter's host time per request where it drafted: its lookups plus the
    # selection over the trees (what drafting.ngram_pays weighs).
    ngram_host_ms: float = 0.0
    ngram_lookup_ms: float = 0.0  # this iteration's lookups
    # The drafter's time per prompt token it ingests beside the target's prefill: part
    # of what a prefill token costs the iteration.
    ingest_ms: float = 0.0
    # ... per prompt token it ingested (the plain requests' chunks it does not): what
    # drafting for a request costs in prefill (admission.relaxed).
    drafter_ingest_ms: float = 0.0
    # What decoding requests actually waited per token lately (iteration time, prefill
    # chunks and drafting included, over tokens emitted per request) and at what batch
    # size: calibrates the modelled TPOT curve routers read (Engine.load).
    tpot_seen: tuple[float, float] | None = None  # (ms, batch)

    def observe_tpot(self, batch: int, emitted: int, iteration_ms: float) -> None:
        if emitted <= 0 or not iteration_ms > 0:
            return
        ms = iteration_ms * batch / emitted  # per token of one request
        if self.tpot_seen is None:
            self.tpot_seen = (ms, float(batch))
            return
        seen_ms, seen_batch = self.tpot_seen
        self.tpot_seen = (
            ewma(seen_ms, ms, TPOT_ALPHA),
            ewma(seen_batch, float(batch), TPOT_ALPHA),
        )
