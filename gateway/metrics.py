"""Prometheus metrics of the gateway: what clients see, per SLO class.

Timings are taken where the client would take them (chunk arrival at the gateway), so
TTFT includes queueing and prefill and TPOT includes the network hop. A request
attains its SLO when (t_last - t_first) / (n_tokens - 1) <= tpot_slo (DESIGN.md 5);
goodput counts the tokens of attaining requests (rate() of it is tokens/s).
Each app owns its registry, so several gateways in one process never collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


@dataclass
class RequestTimes:
    """Gateway-side clock readings of one request (seconds, monotonic)."""

    t_submit: float
    t_first: float | None = None
    t_last: float | None = None
    n_tokens: int = 0

    def on_tokens(self, now: float, n: int) -> None:
        if n <= 0:
            return
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.n_tokens += n

    @property
    def tpot_s(self) -> float | None:
        if self.n_tokens < 2 or self.t_first is None or self.t_last is None:
            return None
        return (self.t_last - self.t_first) / (self.n_tokens - 1)

    def attained(self, tpot_slo_ms: float, ttft_slo_ms: float | None = None) -> bool:
        """Both SLOs met: TTFT (where set) and TPOT."""
        if ttft_slo_ms is not None and (
            self.t_first is None or (self.t_first - self.t_submit) * 1000.0 > ttft_slo_ms
        ):
            return False
        tpot = self.tpot_s
        # One token has no inter-token time: nothing to violate.
        return tpot is None or tpot * 1000.0 <= tpot_slo_ms


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "adaserve_gateway_requests_total",
            "Finished requests by endpoint, HTTP status and SLO class",
            ["endpoint", "status", "slo_class"],
            registry=r,
        )
        self.in_flight = Gauge(
            "adaserve_gateway_requests_in_flight", "Requests being served", registry=r
        )
        self.ttft = Histogram(
            "adaserve_gateway_time_to_first_token_seconds",
            "Time to first token",
            ["slo_class"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "adaserve_gateway_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            ["slo_class"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "adaserve_gateway_e2e_request_latency_seconds",
            "Request latency",
            ["slo_class"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.slo_requests = Counter(
            "adaserve_gateway_slo_requests_total",
            "Completed requests judged against their TPOT SLO",
            ["slo_class"],
            registry=r,
        )
        self.slo_attained = Counter(
            "adaserve_gateway_slo_attained_total",
            "Completed requests that met their TPOT SLO",
            ["slo_class"],
            registry=r,
        )
        self.slo_attainment = Gauge(
            "adaserve_gateway_slo_attainment_ratio",
            "Fraction of completed requests that met their TPOT SLO",
            ["slo_class"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "adaserve_gateway_generation_tokens_total",
            "Generated tokens",
            ["slo_class"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "adaserve_gateway_prompt_tokens_total", "Prompt tokens", ["slo_class"], registry=r
        )
        self.goodput_tokens = Counter(
            "adaserve_gateway_goodput_tokens_total",
            "Generated tokens of requests that met their TPOT SLO",
            ["slo_class"],
            registry=r,
        )
        self.best_effort = Counter(
            "adaserve_gateway_best_effort_requests_total",
            "Requests served best-effort (SLO unattainable at admission)",
            ["slo_class"],
            registry=r,
        )
        self.healthy_units = Gauge(
            "adaserve_gateway_healthy_units", "Healthy verifier units", registry=r
        )
        self.routed = Counter(
            "adaserve_gateway_routing_decisions_total",
            "Requests routed, by why the unit was chosen: prefix (holds its prefix, SLO "
            "met), slo (SLO met), overloaded (no unit met it: the most headroom), stale "
            "(no fresh load report: least outstanding), least_outstanding (policy)",
            ["reason"],
            registry=r,
        )
        self._counts: dict[str, tuple[int, int]] = {}

    def finished(
        self,
        slo_class: str,
        tpot_slo_ms: float,
        times: RequestTimes,
        now: float,
        num_prompt_tokens: int,
        best_effort: bool,
        ttft_slo_ms: float | None = None,
    ) -> None:
        """A request completed (stop or length): record latency and SLO outcome (both
        SLOs met; the TTFT one where set)."""
        if times.t_first is not None:
            self.ttft.labels(slo_class).observe(times.t_first - times.t_submit)
        if (tpot := times.tpot_s) is not None:
            self.tpot.labels(slo_class).observe(tpot)
        self.e2e.labels(slo_class).observe(now - times.t_submit)
        self.generated_tokens.labels(slo_class).inc(times.n_tokens)
        self.prompt_tokens.labels(slo_class).inc(num_prompt_tokens)
        if best_effort:
            self.best_effort.labels(slo_class).inc()
        ok = times.attained(tpot_slo_ms, ttft_slo_ms)
        self.slo_requests.labels(slo_class).inc()
        if ok:
            self.slo_attained.labels(slo_class).inc()
            self.goodput_tokens.labels(slo_class).inc(times.n_tokens)
        total, good = self._counts.get(slo_class, (0, 0))
        total, good = total + 1, good + int(ok)
        self._counts[slo_class] = (total, good)
        self.slo_attainment.labels(slo_class).set(good / total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
