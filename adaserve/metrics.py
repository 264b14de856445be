"""Prometheus metrics of the engine, named after vLLM's where one exists.

Module-level collectors in the default registry: one engine per process in
deployment; tests that build several engines only see counters add up.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
)

requests_total = Counter(
    "adaserve_engine_requests_total",
    "Finished requests by reason and SLO class",
    ["finish_reason", "slo_class"],
)
num_running = Gauge("adaserve_num_requests_running", "Requests in the decode batch")
num_waiting = Gauge("adaserve_num_requests_waiting", "Requests waiting for admission")
kv_usage = Gauge("adaserve_kv_cache_usage_perc", "Fraction of target KV blocks in use")
drafter_kv_usage = Gauge(
    "adaserve_drafter_kv_cache_usage_perc", "Fraction of the in-process drafter's KV blocks in use"
)
preemptions_total = Counter(
    "adaserve_num_preemptions_total", "Requests preempted (KV freed, recomputed later)"
)
prefix_cache_queries = Counter(
    "adaserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"
)
prefix_cache_hits = Counter(
    "adaserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not recomputed)"
)

attention_backend = Gauge(
    "adaserve_attention_backend",
    "1 for the attention backend each model of this process runs (model.attention_backend)",
    ["role", "backend"],
)
model_quantization = Gauge(
    "adaserve_model_quantization",
    "1 for what each model's weights run as (model.quantization: none, int8, int4, stored)",
    ["role", "quantization"],
)

iterations_total = Counter("adaserve_iterations_total", "Decode iterations")
prefill_tokens_total = Counter(
    "adaserve_prefill_tokens_total",
    "Prompt tokens prefilled (chunks, in decode iterations or alone)",
)
iteration_seconds = Histogram(
    "adaserve_iteration_seconds",
    "Iteration latency by phase",
    ["phase"],
    buckets=_LATENCY_BUCKETS,
)
budget_used = Histogram(
    "adaserve_budget_used_tokens",
    "Tree tokens verified per iteration",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
)
batch_size = Histogram(
    "adaserve_batch_size",
    "Requests per decode iteration",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
selections_total = Counter(
    "adaserve_selections_total",
    "Tree selections by where they ran: the scheduler service (remote) or in-process "
    "(local, with a scheduler service configured: scheduler.remote_select auto found it "
    "faster, or a probe of the service)",
    ["where"],
)
fallbacks_total = Counter(
    "adaserve_fallbacks_total",
    "Iterations that fell back (drafter: plain decoding; scheduler: in-process selection)",
    ["component"],
)
optimal_invalid_total = Counter(
    "adaserve_selection_optimal_invalid_total",
    "Iterations where policy optimal (Algorithm 1) found no allocation meeting every "
    "request's A(r), so policy adaserve selected instead",
)
request_errors_total = Counter(
    "adaserve_request_errors_total",
    "Requests ended with finish reason error by a failure of their own, by the phase it "
    "happened in (adaserve/isolation.py PHASES); the other requests went on",
    ["phase"],
)
drafter_resyncs_total = Counter(
    "adaserve_drafter_resyncs_total", "Requests whose draft state was rebuilt from history"
)

# Speculative decoding, as vLLM's spec-decode metrics.
spec_num_drafts = Counter("adaserve_spec_decode_num_drafts_total", "Trees verified")
spec_num_draft_tokens = Counter(
    "adaserve_spec_decode_num_draft_tokens_total", "Drafted tokens verified (roots excluded)"
)
spec_num_accepted_tokens = Counter(
    "adaserve_spec_decode_num_accepted_tokens_total", "Drafted tokens accepted"
)
spec_accepted_per_pos = Counter(
    "adaserve_spec_decode_num_accepted_tokens_per_pos_total",
    "Accepted drafted tokens by depth in the tree",
    ["position"],
)
spec_acceptance_estimate = Gauge(
    "adaserve_spec_decode_acceptance_estimate",
    "Learned per-level acceptance of drafted trees (scheduler.adaptive.learn_acceptance)",
)
spec_emitted_tokens = Counter(
    "adaserve_spec_decode_num_emitted_tokens_total", "Tokens emitted (accepted + bonus)"
)

# Per speculation method: the source that drafted each verified tree (methods.SOURCES;
# "none": plain decoding, "model+ngram": merged trees). Tokens per step of a method =
# its emitted tokens / its steps; its acceptance = accepted / draft tokens.
spec_method_steps = Counter(
    "adaserve_spec_decode_method_steps_total",
    "Verifications (one request, one iteration) by the method that drafted the tree",
    ["method"],
)
spec_method_emitted_tokens = Counter(
    "adaserve_spec_decode_method_emitted_tokens_total",
    "Tokens emitted (accepted + bonus) by the method that drafted the tree",
    ["method"],
)
spec_method_draft_tokens = Counter(
    "adaserve_spec_decode_method_draft_tokens_total",
    "Drafted tokens verified by the method that drafted them",
    ["method"],
)
spec_method_accepted_tokens = Counter(
    "adaserve_spec_decode_method_accepted_tokens_total",
    "Drafted tokens accepted by the method that drafted them",
    ["method"],
)
spec_method_tokens_per_step = Gauge(
    "adaserve_spec_decode_method_tokens_per_step",
    "Recent tokens emitted per verification by method (decayed over ~100 iterations)",
    ["method"],
)
spec_method_acceptance = Gauge(
    "adaserve_spec_decode_method_acceptance",
    "Recent fraction of verified draft tokens accepted by method (decayed)",
    ["method"],
)

# Per SLO class, from the engine's own clock (the gateway keeps its client-side view).
ttft_seconds = Histogram(
    "adaserve_engine_ttft_seconds",
    "Time to first token",
    ["slo_class"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
tpot_seconds = Histogram(
    "adaserve_engine_tpot_seconds",
    "Mean time per output token after the first",
    ["slo_class"],
    buckets=_LATENCY_BUCKETS,
)
slo_attained_total = Counter(
    "adaserve_engine_slo_attained_total",
    "Finished requests that met their SLO: TTFT (where set) and TPOT both",
    ["slo_class"],
)
slo_missed_total = Counter(
    "adaserve_engine_slo_missed_total",
    "Finished requests that missed their TTFT or TPOT SLO",
    ["slo_class"],
)
ttft_slo_total = Counter(
    "adaserve_engine_ttft_slo_total",
    "Finished requests by whether their first token met the TTFT SLO (none set: met)",
    ["slo_class", "outcome"],
)
tpot_slo_total = Counter(
    "adaserve_engine_tpot_slo_total",
    "Finished requests of two or more tokens by whether they met the TPOT SLO",
    ["slo_class", "outcome"],
)
goodput_tokens_total = Counter(
    "adaserve_engine_goodput_tokens_total",
    "Output tokens of requests that met their SLO",
    ["slo_class"],
)
best_effort_total = Counter(
    "adaserve_best_effort_requests_total",
    "Requests admitted best-effort (SLO unattainable)",
    ["slo_class"],
)
ttft_lost_total = Counter(
    "adaserve_ttft_lost_requests_total",
    "Requests whose first token could no longer meet the TTFT SLO, served after those "
    "that still could (scheduler.defer_lost_ttft)",
    ["slo_class"],
)

# Fleet: whether this unit can take more at its SLOs (autoscaling, routing dashboards).
slo_pressure = Gauge(
    "adaserve_slo_pressure",
    "Predicted TPOT of one more request / the tightest TPOT SLO the unit holds: above 1 "
    "the unit cannot take another request at its SLOs (0 when idle)",
)
predicted_tpot_seconds = Gauge(
    "adaserve_predicted_tpot_seconds",
    "Predicted time per output token of a request admitted now (batch + 1)",
)
predicted_queue_seconds = Gauge(
    "adaserve_predicted_queue_seconds",
    "Predicted time to prefill the prompts already waiting (what a new prompt queues behind)",
)
running_on_slo_ratio = Gauge(
    "adaserve_running_on_slo_ratio",
    "Fraction of decoding requests whose TPOT so far is within their SLO (1 when none)",
)
draining = Gauge("adaserve_draining", "1 while the unit drains (SIGTERM): no new requests")
baseline_tpot_seconds = Gauge(
    "adaserve_baseline_tpot_seconds",
    "Baseline TPOT (plain decoding, batch 8) the SLO classes resolve against: configured, "
    "or measured at startup and again while a busy host left it unsettled",
)
baseline_recalibrations_total = Counter(
    "adaserve_baseline_recalibrations_total",
    "Re-measurements of the baseline TPOT that replaced a value measured on a busy host",
)


# vLLM's names for the series that mean the same here, so a dashboard built for vLLM
# (which filters on `model_name`) finds them: re-emitted at scrape time under the vLLM
# name with the model's name as a label; nothing is counted twice. docs/METRICS.md
# maps the rest.
VLLM_NAMES: dict[str, tuple[Counter | Gauge | Histogram, str]] = {
    "vllm:num_requests_running": (num_running, "adaserve_num_requests_running"),
    "vllm:num_requests_waiting": (num_waiting, "adaserve_num_requests_waiting"),
    "vllm:kv_cache_usage_perc": (kv_usage, "adaserve_kv_cache_usage_perc"),
    "vllm:num_preemptions": (preemptions_total, "adaserve_num_preemptions"),
    "vllm:prefix_cache_queries": (prefix_cache_queries, "adaserve_prefix_cache_queries"),
    "vllm:prefix_cache_hits": (prefix_cache_hits, "adaserve_prefix_cache_hits"),
    "vllm:spec_decode_num_drafts": (spec_num_drafts, "adaserve_spec_decode_num_drafts"),
    "vllm:spec_decode_num_draft_tokens": (
        spec_num_draft_tokens,
        "adaserve_spec_decode_num_draft_tokens",
    ),
    "vllm:spec_decode_num_accepted_tokens": (
        spec_num_accepted_tokens,
        "adaserve_spec_decode_num_accepted_tokens",
    ),
    "vllm:spec_decode_num_accepted_tokens_per_pos": (
        spec_accepted_per_pos,
        "adaserve_spec_decode_num_accepted_tokens_per_pos",
    ),
    "vllm:time_to_first_token_seconds": (ttft_seconds, "adaserve_engine_ttft_seconds"),
}


class VllmNames(Collector):
    """The VLLM_NAMES series again under vLLM's names, labelled `model_name`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def describe(self) -> Iterable[Metric]:
        return []  # names are checked against nothing: no collect() at registration

    def collect(self) -> Iterable[Metric]:
        for name, (collector, ours) in VLLM_NAMES.items():
            for family in collector.collect():
                out = Metric(name, family.documentation, family.type)
                for s in family.samples:
                    labels = {**s.labels, "model_name": self.model_name}
                    out.add_sample(name + s.name[len(ours) :], labels, s.value, s.timestamp)
                yield out


def export_vllm_names(model_name: str, registry: CollectorRegistry = REGISTRY) -> VllmNames:
    """Once per process (the verifier, when it serves metrics): add the vLLM names."""
    collector = VllmNames(model_name)
    registry.register(collector)
    return collector
