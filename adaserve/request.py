"""What a client asks for and what it gets back, as values crossing the engine boundary.

Validation happens once, here, so the engine, verifier and gateway can trust the fields.
Errors are `ValueError`s naming the field (the services map them to HTTP 400 /
INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Why a request's stream ended (TokenDelta.finish_reason; None while it runs). The one
# list of them: the wire mapping (services/common/convert.py) is checked against it.
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
# What drafts a request's trees (adaserve/methods.py says what each means).
SPECULATION_METHODS = ("auto", "model", "eagle", "ngram", "none")

# What structured output may constrain a request to (`StructuredOutput.kind`).
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar every output must match (adaserve/grammar.py compiles it).

    kind: "json_schema" (spec: the schema as JSON text), "json_object" (any JSON object;
    spec unused), "regex" (spec: the pattern), "choice" (spec: a JSON list of strings,
    the output is one of them), "grammar" (spec: a Lark or GBNF grammar).
    `field` is the request field it came from, for error messages.
    """

    kind: str
    spec: str = ""
    field: str = "structured_output"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"{self.field}: kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}"
            )
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"{self.field}: an empty {self.kind} constrains nothing")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 -> off
    seed: int | None = None  # same seed -> same tokens, whatever the batch or speculation
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logits processors, applied to the target's logits at every tree node from that
    # node's own history (adaserve/logits_process.py), so speculation changes nothing.
    presence_penalty: float = 0.0  # OpenAI: minus this once a token is in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's output count
    repetition_penalty: float = 1.0  # HF/vLLM: tokens of prompt + output, logit / p (< 0: * p)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_p: float = 0.0  # drop tokens below min_p x the top probability (after temperature)
    min_tokens: int = 0  # stop tokens (eos, stop_token_ids) are held back until this many
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output never completes
    allowed_token_ids: tuple[int, ...] = ()  # vLLM: only these may be emitted; empty: all
    structured: StructuredOutput | None = None  # grammar every output matches
    # None: off; k >= 0: each emitted token's log-probability under the target and the k
    # most likely tokens at its position (the model's own distribution, before processors)
    logprobs: int | None = None
    # None: off; k >= 0: every prompt token's log-probability (but the first's, which
    # nothing scores) and rank under the target, and the k most likely tokens at its
    # position (vLLM's prompt_logprobs: raw log-softmax). Computed during prefill, so
    # such a request's prompt is never taken from the prefix cache.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        # Lists from JSON are accepted and frozen, so the value stays hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids}")
        self._check_processors()

    def _check_processors(self) -> None:
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if not (math.isfinite(v) and lo <= v <= hi):
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise ValueError(f"min_tokens must be an integer, got {self.min_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)
        if any(t < 0 or not (math.isfinite(b) and -100.0 <= b <= 100.0) for t, b in bias):
            raise ValueError("logit_bias: token ids must be >= 0 and biases in [-100, 100]")
        words = tuple(tuple(int(t) for t in w) for w in self.bad_words)
        object.__setattr__(self, "bad_words", words)
        if any(not w or min(w) < 0 for w in words):
            raise ValueError("bad_words: each must be a non-empty sequence of token ids >= 0")
        allowed = tuple(int(t) for t in self.allowed_token_ids)
        object.__setattr__(self, "allowed_token_ids", allowed)
        if any(t < 0 for t in allowed):
            raise ValueError("allowed_token_ids must be token ids >= 0")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        k = self.prompt_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise ValueError(f"prompt_logprobs must be None or an integer, got {k!r}")
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor changes this request's distribution."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words
            or self.allowed_token_ids
            or self.structured is not None
        )

    def token_ids(self) -> list[int]:
        """Every token id the request names (for the engine's vocabulary check)."""
        ids = [t for t, _ in self.logit_bias] + list(self.allowed_token_ids)
        return ids + [t for w in self.bad_words for t in w]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationRequest:
    id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tpot_slo_ms: float
    slo_class: str | None = None
    priority: int = 0  # vLLM-style: lower runs first when admission queues
    timeout_s: float | None = None  # deadline from submission; expired -> aborted everywhere
    ttft_slo_ms: float | None = None  # time to first token from submission; None: no SLO
    # Speculation method (adaserve/methods.py); None: the SLO class's, else the default.
    speculation: str | None = None
    # n > 1: the id of a sibling with the same prompt. This request is admitted once that
    # one's prompt is prefilled, so its prompt's full blocks come from the prefix cache
    # (the sibling's KV, shared) instead of being computed again.
    fork_of: str | None = None

    def __post_init__(self) -> None:
        if self.speculation is not None and self.speculation not in SPECULATION_METHODS:
            raise ValueError(
                f"speculation.method must be one of {', '.join(SPECULATION_METHODS)}; "
                f"got {self.speculation!r}"
            )
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("request id must be a non-empty string")
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.id}: empty prompt")
        if any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.prompt_token_ids
        ):
            raise ValueError(f"request {self.id}: prompt token ids must be integers >= 0")
        if not (math.isfinite(self.tpot_slo_ms) and self.tpot_slo_ms > 0):
            raise ValueError(f"request {self.id}: tpot_slo_ms must be > 0, got {self.tpot_slo_ms}")
        if self.ttft_slo_ms is not None and not (
            math.isfinite(self.ttft_slo_ms) and self.ttft_slo_ms > 0
        ):
            raise ValueError(f"request {self.id}: ttft_slo_ms must be > 0, got {self.ttft_slo_ms}")
        if self.timeout_s is not None and not (self.timeout_s > 0):
            raise ValueError(f"request {self.id}: timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of emitted tokens under the target model's own distribution
    (log_softmax of its logits, before penalties, bias, grammar and temperature: vLLM's
    default "raw" logprobs), from the row that chose each token."""

    logprobs: np.ndarray  # float32 [m]: log p(token i)
    top_ids: np.ndarray  # int32 [m, k]: the k most likely tokens at each position
    top_logprobs: np.ndarray  # float32 [m, k]: their log-probabilities, descending
    # int32 [m]: each token's rank in its row (1: the most likely); prompt logprobs only
    ranks: np.ndarray | None = None

    def head(self, n: int) -> TokenLogprobs:
        ranks = None if self.ranks is None else self.ranks[:n]
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n], ranks)

    @staticmethod
    def concat(parts: list[TokenLogprobs]) -> TokenLogprobs:
        ranks = None
        if parts and all(p.ranks is not None for p in parts):
            ranks = np.concatenate([p.ranks for p in parts if p.ranks is not None])
        return TokenLogprobs(
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.top_ids for p in parts]),
            np.concatenate([p.top_logprobs for p in parts]),
            ranks,
        )


@dataclass(frozen=True)
class TokenDelta:
    token_ids: tuple[int, ...]  # new tokens in this chunk (after stop truncation)
    text: str  # their incremental detokenized text
    finish_reason: str | None  # None | "stop" | "length" | "abort" | "timeout" | "error"
    num_prompt_tokens: int
    num_generated: int  # total so far
    ttft_ms: float | None = None  # set on the first chunk
    best_effort: bool = False  # SLO judged unattainable at admission (policy setting)
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asked for them
    # With the first token, when the request asked for prompt_logprobs: prompt tokens
    # 1 .. P-1, each scored by the row before it (token 0 has no logprob).
    prompt_logprobs: TokenLogprobs | None = None

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be None or one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
