"""Settings shared by the CLI and every service.

One pydantic-settings tree: defaults here, overridden by a YAML file (`--config` or
`ADASERVE_CONFIG`), then by environment variables (`ADASERVE_SCHEDULER__BUDGET=16`),
then by command-line flags. Kubernetes mounts the same YAML the CLI reads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

# What drafts a request's trees (request field `speculation.method`, per SLO class,
# `speculation.default_method`): adaserve/methods.py.
SpeculationMethod = Literal["auto", "model", "eagle", "ngram", "none"]


class SLOClass(BaseModel):
    """A named TPOT SLO: an absolute target, or a multiple of the deployment's baseline
    per-token latency (the AdaServe coding class is 1.2x baseline); optionally a TTFT
    SLO (time to first token, ms) too, and the speculation method its requests get
    when they name none (None: `speculation.default_method`)."""

    tpot_ms: PositiveFloat | None = None
    baseline_scale: PositiveFloat | None = None
    ttft_ms: PositiveFloat | None = None
    speculation: SpeculationMethod | None = None

    @model_validator(mode="after")
    def _one_of(self) -> SLOClass:
        if (self.tpot_ms is None) == (self.baseline_scale is None):
            raise ValueError("an SLO class sets exactly one of tpot_ms or baseline_scale")
        return self

    def resolve_ms(self, baseline_tpot_ms: float) -> float:
        if self.tpot_ms is not None:
            return self.tpot_ms
        assert self.baseline_scale is not None  # _one_of: exactly one of the two is set
        return self.baseline_scale * baseline_tpot_ms


def _default_classes() -> dict[str, SLOClass]:
    # AdaServe EuroSys '26, Table 2.
    return {
        "coding": SLOClass(baseline_scale=1.2),
        "chat": SLOClass(tpot_ms=50.0),
        "summarize": SLOClass(tpot_ms=150.0),
    }


class SLOSettings(BaseModel):
    classes: dict[str, SLOClass] = Field(default_factory=_default_classes)
    default_class: str = "chat"
    # Per-token latency of plain decoding (batch 8) on this hardware, which classes with
    # `baseline_scale` multiply. "auto": the verifier times it on its target at startup.
    baseline_tpot_ms: PositiveFloat | Literal["auto"] = 40.0

    def resolve(self, name: str) -> float:
        if self.baseline_tpot_ms == "auto":
            raise ValueError("slo.baseline_tpot_ms is 'auto': the engine resolves it at startup")
        return self.classes[name].resolve_ms(self.baseline_tpot_ms)


class AdaptiveSettings(BaseModel):
    """Depth/width policy. `eurosys` is paper 001 eq. 8-9; `v1` is paper 000 eq. 8-9."""

    policy: Literal["eurosys", "v1", "fixed"] = "eurosys"
    # 0 lets the plan switch speculation off where it does not pay (a compute-bound
    # batch; vLLM's `speculative_disable_by_batch_size`, but from the cost model).
    d_min: NonNegativeInt = 1
    d_max: PositiveInt = 8
    w_max: PositiveInt = 4
    b1: PositiveInt | None = None  # verifier tokens per step; None -> scheduler.budget
    b2: PositiveInt | None = None  # drafter tokens per step; None -> scheduler.budget
    c1: int = 0
    c2: int = 0
    fixed_depth: PositiveInt = 4
    fixed_width: PositiveInt = 1
    # Cost cap on the eurosys/v1 depth: one drafter step's latency in verifier tokens
    # (the verify time of that many more tree tokens); None -> no cap. With it, d is at
    # most the chain depth that maximizes expected accepted tokens per unit of
    # iteration time (adaserve/adaptive.py), so light load stops paying draft steps for
    # tokens that are rarely accepted.
    draft_cost_tokens: PositiveFloat | None = None
    # ... plus this much per active request: the drafter's per-sequence host work (beam
    # bookkeeping, KV catch-up) grows with the batch even where its forward does not.
    draft_cost_tokens_per_request: NonNegativeFloat = 0.0
    acceptance: float = Field(default=0.75, gt=0.0, lt=1.0)  # per drafted token, for the cap
    # Learn it from the verifications this engine sees, `acceptance` being the prior
    # (adaptive.AcceptanceEstimate): the plan follows the workload's real acceptance.
    learn_acceptance: bool = False
    # Where the cap plans plain decoding, the tightest-SLO requests are still drafted for
    # if the longer iteration keeps every other request within this fraction of its SLO
    # (adaptive.slack_plan); None -> never. Needs draft_cost_tokens (the cost model).
    slack_margin: float | None = Field(default=0.8, gt=0.0, le=1.0)
    # The drafter ends a request's beam search before a step in which none of its
    # beams has a path probability f of at least this (adaserve/speculate.py): the
    # drafter's confidence sets each tree's depth, up to the planned d. None -> off.
    # Where the cost cap plans two or more steps, the depth is then the eurosys/v1 one
    # and the stop rule cuts it short; where it plans one or none, the cap stands.
    draft_stop_prob: float | None = Field(default=None, gt=0.0, lt=1.0)


RemoteSelect = Literal["auto", "always"]  # scheduler.remote_select


class SchedulerSettings(BaseModel):
    budget: PositiveInt = 16  # verifier tokens per iteration (knee of the latency curve)
    # paper: Algorithm 2 exactly; adaserve: with triage and a marginal-value stop
    # (docs/ARCHITECTURE.md). optimal: Algorithm 1; the engine selects with adaserve in an iteration where it is
    # INVALID (counted in adaserve_selection_optimal_invalid_total).
    policy: Literal["adaserve", "paper", "equal", "global", "optimal"] = "adaserve"
    order: Literal["descending_a", "ascending_a"] = "descending_a"
    n_max: PositiveInt | None = None  # None -> ceil(1.2 * budget / n)
    correction_factor: PositiveFloat = 1.05  # inflates predicted t_spec (FlexFlow Serve)
    # Policy adaserve: an iteration's tree budget is at least the tree tokens a forward
    # may carry while the tightest decoding request stays on its TPOT SLO (the latency
    # model's curve; adaserve/batching.py `slo_tree_budget`), not only the knee B.
    # Off by default: it won the EuroSys mix it was tuned on and lost the random sweep
    # (BENCHMARKS.md, "Random workloads"): where the tightest SLO is loose the budget
    # grows to a whole forward, the plan drafts deep for it, and prompts wait.
    slo_budget: bool = False
    # Policy adaserve: while a decoding request is behind its TPOT SLO, admission holds
    # prompts with a TTFT SLO until their deadline nears (batching.hold_prompt).
    hold_prompts: bool = True
    # Policy adaserve: speculation yields to prefill. When the prompts' TTFT deadlines
    # need more prefill than an iteration with drafts carries, the trees give up tokens
    # of the forward as well as time, and the iteration drafts only for the requests
    # plain decoding would leave behind their TPOT SLO (none: a continuous-batching
    # iteration): a draft step costs prefill throughput the deadlines need.
    yield_to_prefill: bool = True
    # Policy adaserve: False -> admitted beside requests with a TTFT SLO, requests whose TPOT
    # SLO plain decoding of a full batch meets (with prefill stretching every
    # iteration) and whose prompt costs the drafter more to ingest than drafts would
    # save over their max_tokens are not drafted for, and the drafter does not ingest
    # their prompts, unless one is behind its SLO (engine/admission.py relaxed). True:
    # every request is drafted for.
    draft_relaxed: bool = False
    # Policy adaserve: a request whose first token can no longer meet its TTFT SLO
    # (prefilling its prompt alone would end past the deadline) is ordered from then on
    # as one without a TTFT SLO, in admission and prefill, so requests that can still
    # meet theirs go first (engine/admission.py defer_lost). Earliest-deadline-first
    # under overload serves the requests already lost and makes the next ones late too.
    defer_lost_ttft: bool = True
    # Policy adaserve: prefill follows the SLOs. Prompts with a TTFT SLO are prefilled
    # first (earliest deadline first, with preempted requests' recomputes, whose TPOT
    # SLO waits on them), and the prompts without one only in the
    # decoding requests' TPOT slack: no SLO waits on their first token, so they may not
    # put a decoding request behind its SLO, nor, once their default deadline comes,
    # go ahead of a prompt whose TTFT SLO still can be met (adaserve/batching.py). Where
    # no request decodes, prompts go by deadline while the TTFT SLOs still hold.
    # False: every prompt by its deadline, in the whole prefill stretch.
    slo_prefill: bool = True
    # With a scheduler service (services.scheduler): `auto` sends a Select to it only
    # while it answers sooner than selecting in-process does (both measured, adaserve/
    # fallback.py). The engine waits for the answer either way, so a remote selection
    # saves time only where its compute saves more than the call costs (a large batch
    # beside a busy verifier host); on one host it never does (BENCHMARKS.md, "Peers").
    # `always`: every Select goes to the service (to watch it, or to test it).
    remote_select: RemoteSelect = "auto"
    adaptive: AdaptiveSettings = Field(default_factory=AdaptiveSettings)


class LatencyCurve(BaseModel):
    tokens: list[PositiveFloat] = Field(min_length=1)
    ms: list[NonNegativeFloat] = Field(min_length=1)
    # Extra ms per thousand (query, earlier prompt token) pairs: what a prefill chunk
    # deep into a long prompt pays for attention beyond the curve's own.
    context_ms: NonNegativeFloat = 0.0

    @model_validator(mode="after")
    def _check(self) -> LatencyCurve:
        if len(self.tokens) != len(self.ms):
            raise ValueError("latency_curve: tokens and ms must have the same length")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError("latency_curve: tokens must be strictly increasing")
        return self


class EngineSettings(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    max_running: PositiveInt = 64
    max_queue: PositiveInt = 256
    # The waiting queue's order when slots or KV gate admission, after `priority`:
    # "deadline" (the TTFT deadline, then the tighter TPOT SLO; engine/admission.py admission_order)
    # or "arrival" (first come, first served: vLLM's fcfs / priority policies).
    admission_order: Literal["deadline", "arrival"] = "deadline"
    kv_block_size: PositiveInt = 16
    kv_blocks: PositiveInt | None = None  # None -> sized from kv_memory_gb
    kv_memory_gb: PositiveFloat = 2.0
    max_model_len: PositiveInt | None = None  # None -> the model's context length
    # The most tokens one forward carries, tree nodes and prefill chunks together
    # (vLLM's max_num_batched_tokens); within it, how many prompt tokens an iteration
    # prefills is what the decoding requests' TPOT SLOs leave room for
    # (adaserve/batching.py). `prefill_chunk`, its earlier name, is read too.
    max_batch_tokens: PositiveInt = Field(
        default=512, validation_alias=AliasChoices("max_batch_tokens", "prefill_chunk")
    )
    # Prompt tokens every iteration prefills while prompts wait, however tight the
    # running requests' SLOs: prefill slows down under them but never stops.
    min_prefill_tokens: PositiveInt = 8
    # Prefill chunks may lengthen an iteration to at most this multiple of its decode
    # work: the most a prompt that arrives slows the streams already running (TTFT
    # deadlines may push further, into the running requests' TPOT slack). Higher:
    # faster TTFT, more jitter.
    prefill_stretch: float = Field(default=2.0, ge=1.0, allow_inf_nan=False)
    # Automatic prefix caching (target and drafter): full KV blocks are shared by
    # requests whose tokens start alike, and kept, least recently used evicted first.
    prefix_caching: bool = True
    # Fraction of KV blocks kept free at admission (vLLM's watermark): room for the
    # running requests to grow before preemption has to make it.
    kv_watermark: float = Field(default=0.01, ge=0.0, lt=1.0)
    # Forward latency (ms) against tokens per forward, e.g. from `adaserve profile`;
    # None: measured at startup where slo.baseline_tpot_ms is auto, else a knee-shaped
    # prior from the baseline and scheduler.budget. A learned drift factor scales it.
    latency_curve: LatencyCurve | None = None
    speculation_timeout_ms: PositiveFloat = 500.0
    scheduler_timeout_ms: PositiveFloat = 200.0
    speculation: bool = True
    # A TPOT SLO below the deployment's floor (the best TPOT one request alone can
    # expect: adaptive.slo_floor, judged when the request is submitted) is not expected
    # to hold: serve it best-effort, flagged in the response and metrics (default), or
    # refuse it at admission with 400 / INVALID_ARGUMENT.
    unattainable_slo: Literal["best_effort", "reject"] = "best_effort"


class NgramSettings(BaseModel):
    """The n-gram drafter in the verifier (adaserve/ngram.py): trees from matches of a
    request's recent tokens in its own prompt and output."""

    enabled: bool = True
    min_n: PositiveInt = 1  # the shortest match that drafts
    max_n: PositiveInt = 16  # matches are compared backwards this far at most
    max_matches: PositiveInt = 32  # most recent occurrences a tree is built from
    # Pseudo-continuations agreeing with nothing, fewer for longer matches:
    # q = count / (matches + prior_count / match_length ** length_power) (ngram.py).
    prior_count: PositiveFloat = 2.2
    length_power: NonNegativeFloat = 1.6
    # Its draft steps cost no forward, so it drafts deeper than the model; selection
    # verifies only the nodes whose f pays for their verify time.
    depth: PositiveInt = 8
    width: PositiveInt = 2
    # Prior of its learned per-level acceptance (where it proposes a tree), which
    # decides whether `auto` verifies its trees where the model does not draft.
    acceptance: float = Field(default=0.5, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _check(self) -> NgramSettings:
        if self.min_n > self.max_n:
            raise ValueError("speculation.ngram: min_n must be <= max_n")
        return self


class SpeculationSettings(BaseModel):
    """Which drafter drafts each request (adaserve/methods.py): `auto` picks per request
    and per iteration from the learned acceptance of each method, the load and the SLO;
    an SLO class may set its own (`slo.classes.<name>.speculation`), a request its own
    (`speculation.method`)."""

    default_method: SpeculationMethod = "auto"
    ngram: NgramSettings = Field(default_factory=NgramSettings)
    # The draft model reads at most this many of a prompt's last tokens (None: all of
    # it). Its prefill of a long prompt is forward time every waiting prompt pays for,
    # while its next-token guesses depend mostly on the recent context (MagicDec,
    # arXiv 2408.11049, drafts long contexts from a window). The embedded drafter even
    # agrees with its target more from the last 512 tokens of a ~3k-token prompt than
    # from all of them (BENCHMARKS.md, "Long prompts"). Output stays the target's:
    # only the drafts see less. Not for an EAGLE head, which reads the target's features.
    draft_context: PositiveInt | None = 512


class ServiceAddresses(BaseModel):
    scheduler: str | None = None  # host:port; None -> in-process selection
    drafter: str | None = None  # host:port; None -> in-process drafter
    verifiers: list[str] = Field(default_factory=list)  # gateway -> verifier units
    verifier_dns: str | None = None  # headless Service name; resolved to unit addresses


AttentionBackendName = Literal["auto", "reference", "triton", "flashinfer"]
ATTENTION_BACKEND_CHOICES: tuple[str, ...] = get_args(AttentionBackendName)  # for CLI flags


class ModelSettings(BaseModel):
    target: str = "embedded"
    drafter: str | None = "embedded"  # None -> no speculation
    tp: PositiveInt = 1
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"  # auto -> cuda if available else cpu
    served_name: str | None = None  # the `model` clients send; None -> derived from target
    # What the target's weights run as (adaserve/model/stored.py). "stored": a GGUF
    # target's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K tensors as the file stores them,
    # dequantized in registers by the packed CPU kernel (the same logits as "none", bit for bit, from a
    # sixth of the bytes for Q4_1; one-rank float32 CPU only, refused elsewhere).
    # "none": float32 (bfloat16 on a GPU) weights, the GGUF dequantized at conversion.
    # "int8": weight-only int8 per output feature on a CPU (logits change slightly; an
    # fp32 Hugging Face target's option). "int4": weight-only int4 per group of 32 input
    # features (Q4_1 blocks made at load; the LM head Q8_0) on the stored kernel, with
    # stored_activations: any float32 model, a Hugging Face directory included; a CPU
    # option (on a GPU it runs unquantized, reported as none). "auto": stored where it
    # runs, else none. Speculation stays lossless under each: the quantized target is
    # the reference its own plain decoding defines.
    # Logged at startup, in /v1/models and as adaserve_model_quantization.
    quantization: Literal["auto", "none", "stored", "int8", "int4"] = "auto"
    # What stored weights multiply (model.quantization stored or int4, and an int4
    # drafter's). "int8": each token row
    # quantized per block of 32 features to int8 with a float scale (ggml's Q8_1) and
    # integer dot products per block, as llama.cpp does: 1.5-2.9x faster linear layers
    # than "float32", logits within the activation rounding of the float32 ones (a
    # row's result still never depends on the rows beside it, so speculation stays
    # lossless). "float32": the weights dequantized exactly, the same logits as "none".
    stored_activations: Literal["float32", "int8"] = "float32"
    # "int8": where the drafter runs on a CPU, its linear layers run as dynamic int8
    # (about twice as fast a draft step; output unchanged, the target verifies every
    # token). "int4": Q4_1 blocks as the target's int4, multiplying stored_activations.
    # Ignored on a GPU, so one settings file serves both.
    drafter_quantization: Literal["none", "int8", "int4"] = "none"
    # "auto": float32 models on an x86-64 CPU with AVX-512 or AVX2 run their linear
    # layers on adaserve's packed few-row kernel (built with g++ on first use; MKL where
    # it cannot be), which verifies a 5-token tree in ~1.1x a plain decode step instead
    # of MKL's 1.5-3x, and their RMSNorms and small-batch tree attention on ops built
    # with it. "mkl": always MKL and torch's own ops (adaserve/model/cpu_gemm.py,
    # cpu_ops.py).
    cpu_kernel: Literal["auto", "mkl"] = "auto"
    # Tree attention for target and drafter (adaserve/model/attention.py). "auto":
    # FlashInfer where it imports on a CUDA device, else Triton on CUDA, else the
    # reference (on a CPU the packed kernel's attention where it builds). "triton" or
    # "flashinfer" where it cannot run (no CUDA device, package missing) fails at
    # startup. The backend in use is logged and exported as
    # adaserve_attention_backend{role, backend}.
    attention_backend: AttentionBackendName = "auto"


class GatewaySettings(BaseModel):
    max_tokens_limit: PositiveInt = 4096
    max_prompt_chars: PositiveInt = 200_000
    max_stop_strings: PositiveInt = 8
    # Sequences per prompt (n, and best_of) and prompts per /v1/completions request.
    max_n: PositiveInt = 16
    max_prompts: PositiveInt = 32
    # Fields no OpenAI or vLLM schema adaserve knows: ignored with a warning in the
    # gateway's log naming them (vLLM's behaviour, so newer clients keep working) or
    # refused with a 400 naming the first (OpenAI's). Known fields are always honoured
    # or refused, never ignored.
    unknown_fields: Literal["ignore", "reject"] = "ignore"
    # Requests larger than these are refused (413 / 431) before they are parsed; the
    # body limit also caps the gRPC front's message size.
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    max_header_bytes: PositiveInt = 64 * 1024
    api_keys_file: str | None = None
    api_keys_env: str = "ADASERVE_API_KEYS"
    metrics_require_auth: bool = False
    health_interval_s: PositiveFloat = 2.0


class FleetSettings(BaseModel):
    """Operating several serving units: how they report their load, how gateways route
    by it (adaserve/routing.py), how a unit drains and how its liveness is judged."""

    # slo: each request to the unit where its TPOT (and TTFT) SLO is most likely met
    # without breaking the others', preferring the unit holding its prefix;
    # least_outstanding: the unit with the fewest of this gateway's requests in flight.
    routing: Literal["slo", "least_outstanding"] = "slo"
    report_interval_ms: PositiveFloat = 100.0  # a unit's load report period (Load stream)
    # A report older than this is not trusted: the unit gets no request while another
    # reports fresh; with none fresh, routing is least outstanding.
    report_stale_ms: PositiveFloat = 1000.0
    # Above this KV usage a unit is preempting: routing sends it nothing it can avoid.
    kv_limit: float = Field(default=0.95, gt=0.0, le=1.0)
    # Prefix keys a unit remembers (LRU) for prefix-affine routing.
    prefix_keys: PositiveInt = 4096
    # SIGTERM: the longest a unit lets its in-flight streams run before it exits. Keep
    # it under the pod's terminationGracePeriodSeconds (the manifests' test checks).
    drain_timeout_s: NonNegativeFloat = 50.0
    # Liveness fails once the engine loop has made no progress for this long (a wedged
    # forward); keep it above the slowest iteration (a long prefill chunk on a GPU).
    liveness_timeout_s: PositiveFloat = 60.0


class TLSSettings(BaseModel):
    """Mutual TLS between adaserve services, off unless the three files are set. Each
    service presents `cert_file`/`key_file` and trusts peers whose certificate chains to
    `ca_file`, as a server and as a client; the gateway's public fronts stay as they are.
    Environment: ADASERVE_TLS__CA_FILE, ADASERVE_TLS__CERT_FILE, ADASERVE_TLS__KEY_FILE."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    # Name to expect in the peer's server certificate when it differs from the host
    # dialled (e.g. addresses by IP, certificates by Service name).
    server_name: str | None = None

    @model_validator(mode="after")
    def _all_or_none(self) -> TLSSettings:
        files = (self.ca_file, self.cert_file, self.key_file)
        if any(files) and not all(files):
            raise ValueError("tls: set all of ca_file, cert_file and key_file, or none")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ADASERVE_", env_nested_delimiter="__", extra="ignore"
    )

    model: ModelSettings = Field(default_factory=ModelSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    slo: SLOSettings = Field(default_factory=SLOSettings)
    speculation: SpeculationSettings = Field(default_factory=SpeculationSettings)
    services: ServiceAddresses = Field(default_factory=ServiceAddresses)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    tls: TLSSettings = Field(default_factory=TLSSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    log_prompts: bool = False


def load_settings(path: str | os.PathLike | None = None, **overrides) -> Settings:
    """YAML file (or $ADASERVE_CONFIG) < environment < explicit overrides."""
    path = path or os.environ.get("ADASERVE_CONFIG")
    data: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}")
        data = yaml.safe_load(p.read_text()) or {}
        try:
            check_keys(data)
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from None
    # Environment wins over the file: BaseSettings reads env for fields not passed in,
    # so merge env-derived values over the file's explicitly.
    env = Settings().model_dump(exclude_unset=True)
    merged = _deep_merge(_deep_merge(data, env), overrides)
    return Settings(**merged)


def check_keys(values: dict, model: type[BaseModel] = Settings, where: str = "") -> None:
    """ValueError on a key no setting has (field names and their aliases, nested
    sections checked in turn): pydantic ignores unknown keys, and a typo in a settings
    file or a --set would otherwise run the default without a word."""
    names: dict[str, FieldInfo] = {}
    for name, f in model.model_fields.items():
        names[name] = f
        for alias in getattr(f.validation_alias, "choices", ()):  # AliasChoices
            if isinstance(alias, str):
                names[alias] = f
    for key, value in values.items():
        field = names.get(key)
        if field is None:
            known = ", ".join(sorted(model.model_fields))
            raise ValueError(f"{where}{key}: no such setting (known here: {known})")
        sub = field.annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            check_keys(value, sub, f"{where}{key}.")


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out
