"""Request bodies of the OpenAI completion and chat APIs, plus adaserve's extras.

Structural checks live here (types, ranges, what adaserve cannot honour); checks that
depend on settings or on the serving units (token limits, model names, SLO classes)
happen in `gateway.spec`. Unknown fields are ignored, as the OpenAI API does, so newer
clients keep working.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
MAX_STOP_CHARS = 256
# Echoed in ids and logs: a safe alphabet keeps log lines and headers unforgeable.
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=_INT32_MAX)]


def _not_offered(message: str) -> PydanticCustomError:
    """An API feature adaserve does not offer: the gateway answers 400, code "unsupported"."""
    return PydanticCustomError("unsupported", message)


class _Body(BaseModel):
    # Strict: `"timeout": true` or `"max_tokens": "16"` are not numbers; coercing them
    # would accept what the published schema says is invalid (found by the fuzz test).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SpeculationOptions(_Body):
    """adaserve extra: what drafts the request's trees (adaserve/methods.py)."""

    method: Literal["auto", "model", "eagle", "ngram", "none"]


class _Common(_Body):
    """Fields shared by both endpoints."""

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    temperature: FiniteFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: FiniteFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=_INT32_MAX)  # -1 or 0: off (vLLM)
    seed: int | None = Field(default=None, ge=-(2**63), le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: FiniteFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # adaserve / vLLM extras
    tpot_slo_ms: FiniteFloat | None = Field(default=None, gt=0.0, le=3_600_000.0)
    ttft_slo_ms: FiniteFloat | None = Field(default=None, gt=0.0, le=3_600_000.0)
    slo_class: str | None = Field(default=None, min_length=1, max_length=64)
    priority: int = Field(default=0, ge=-_INT32_MAX, le=_INT32_MAX)
    request_id: str | None = None
    timeout: FiniteFloat | None = Field(default=None, gt=0.0, le=86_400.0)
    speculation: SpeculationOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        for s in stops:
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, v: str | None) -> str | None:
        if v is not None and not REQUEST_ID_RE.match(v):
            raise ValueError("request_id must be 1-128 characters of [A-Za-z0-9._:-]")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> _Common:
        # Silently ignoring these would return output the client did not ask for.
        if self.presence_penalty or self.frequency_penalty:
            raise _not_offered("presence_penalty and frequency_penalty are not supported")
        if self.logit_bias:
            raise _not_offered("logit_bias is not supported")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        # A batch of one is accepted; real batches need n parallel streams we do not offer.
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise _not_offered("echo is not supported")
        if self.logprobs:
            raise _not_offered("logprobs is not supported")
        if self.suffix:
            raise _not_offered("suffix is not supported")
        if self.best_of is not None and self.best_of > 1:
            raise _not_offered("best_of > 1 is not supported")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _chat_unsupported(self) -> ChatCompletionRequest:
        if self.logprobs or self.top_logprobs:
            raise _not_offered("logprobs is not supported")
        if self.tools:
            raise _not_offered("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise _not_offered("response_format other than text is not supported")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error the gateway returns, as the OpenAI API shapes it."""

    error: ErrorDetail
