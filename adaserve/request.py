"""What a client asks for and what it gets back, as values crossing the engine boundary.

Validation happens once, here, so the engine, verifier and gateway can trust the fields.
Errors are `ValueError`s naming the field (the services map them to HTTP 400 /
INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Why a request's stream ended (TokenDelta.finish_reason; None while it runs). The one
# list of them: the wire mapping (services/common/convert.py) is checked against it.
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
# What drafts a request's trees (adaserve/methods.py says what each means).
SPECULATION_METHODS = ("auto", "model", "eagle", "ngram", "none")


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
class TokenDelta:
    token_ids: tuple[int, ...]  # new tokens in this chunk (after stop truncation)
    text: str  # their incremental detokenized text
    finish_reason: str | None  # None | "stop" | "length" | "abort" | "timeout" | "error"
    num_prompt_tokens: int
    num_generated: int  # total so far
    ttft_ms: float | None = None  # set on the first chunk
    best_effort: bool = False  # SLO judged unattainable at admission (policy setting)
    error: str | None = None

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be None or one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
