"""Request bodies of the OpenAI completion and chat APIs, plus adaserve's and vLLM's
extras.

Structural checks live here (types, ranges); checks that depend on settings or on the
serving units (token limits, model names, SLO classes) and the refusal of features
adaserve does not offer happen in `gateway.spec`. Nothing the client sends is dropped
without a word: every field of OpenAI's schema and every vLLM extra listed here is
either honoured or refused with a 400 naming it (`refusal`); fields nobody knows are
ignored with a warning in the gateway's log, as vLLM does (newer clients keep working),
or refused as OpenAI does, with `gateway.unknown_fields: reject` (`unknown_fields`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs; vLLM's default max_logprobs
# Echoed in ids and logs: a safe alphabet keeps log lines and headers unforgeable.
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=_INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class _Body(BaseModel):
    # Strict: `"timeout": true` or `"max_tokens": "16"` are not numbers; coercing them
    # would accept what the published schema says is invalid (found by the fuzz test).
    # Unknown fields are kept (not dropped unseen) so `unknown_fields` can name them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of every field no model here declares, at any depth."""
    out = [prefix + k for k in (body.model_extra or {})]
    for name in type(body).model_fields:
        value = getattr(body, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, _Body):
                at = f"{name}.{i}." if isinstance(value, list) else f"{name}."
                out += unknown_fields(item, prefix + at)
    return out


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: Any = None  # vLLM: refused (usage comes once, at the end)


# -- structured output -----------------------------------------------------------------


class JsonSchemaFormat(_Body):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # always strict here: the grammar enforces the schema


class ResponseFormat(_Body):
    """OpenAI's response_format, and Text Generation Inference's grammar in it:
    `{"type": "json", "value": schema}` (`json_object` with a `value` is the same, and is
    what huggingface_hub's InferenceClient sends for a `json_schema` format) and
    `{"type": "regex", "value": pattern}`."""

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: JsonSchemaFormat | None = None
    value: dict[str, Any] | str | None = None  # TGI's grammar: a schema or a pattern

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        if self.value is not None and self.type in ("text", "json_schema"):
            raise ValueError(f"value: a grammar for type json or regex, not {self.type}")
        if self.type == "json" and self.value is None:
            raise ValueError("value (a JSON schema) is required when type is json")
        if self.type == "regex" and not isinstance(self.value, str):
            raise ValueError("value (a regular expression) is required when type is regex")
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"json_schema: only with type json_schema, not {self.type}")
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (the newer spelling of the guided_* fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None  # refused
    whitespace_pattern: Any = None  # refused


# -- tools -----------------------------------------------------------------------------


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


# -- the requests ----------------------------------------------------------------------


def _refuse(when: Callable[[Any], bool], why: str) -> tuple[Callable[[Any], bool], str]:
    return when, why


_set = bool  # a refused feature counts as asked for when its value is truthy
# Fields adaserve knows and does not offer, refused (400, code "unsupported") when set
# to anything that would change the output; the value that changes nothing is accepted.
_REFUSED_COMMON = {
    "use_beam_search": _refuse(_set, "beam search is not supported"),
    "length_penalty": _refuse(
        lambda v: v is not None and v != 1.0, "length_penalty (beam search) is not supported"
    ),
    "include_stop_str_in_output": _refuse(_set, "include_stop_str_in_output is not supported"),
    "skip_special_tokens": _refuse(
        lambda v: v is False, "skip_special_tokens: false is not supported"
    ),
    "spaces_between_special_tokens": _refuse(
        lambda v: v is False, "spaces_between_special_tokens: false is not supported"
    ),
    "truncate_prompt_tokens": _refuse(
        lambda v: v is not None, "truncate_prompt_tokens is not supported"
    ),
    "logits_processors": _refuse(_set, "custom logits_processors are not supported"),
    "guided_whitespace_pattern": _refuse(
        lambda v: v is not None, "guided_whitespace_pattern is not supported"
    ),
    "guided_decoding_backend": _refuse(
        lambda v: v not in (None, "auto", "guidance", "llguidance"),
        "guided_decoding_backend: only llguidance (guidance) is supported",
    ),
    "cache_salt": _refuse(lambda v: v is not None, "cache_salt is not supported"),
    "kv_transfer_params": _refuse(lambda v: v is not None, "kv_transfer_params is not supported"),
    "vllm_xargs": _refuse(lambda v: v is not None, "vllm_xargs is not supported"),
    "store": _refuse(_set, "store: true is not supported (nothing is stored)"),
    "metadata": _refuse(_set, "metadata (for stored completions) is not supported"),
    "service_tier": _refuse(
        lambda v: v not in (None, "auto", "default"),
        "service_tier other than auto or default is not supported",
    ),
}
_REFUSED_CHAT = {
    "functions": _refuse(_set, "functions (deprecated) is not supported: use tools"),
    "function_call": _refuse(
        lambda v: v is not None, "function_call (deprecated) is not supported: use tool_choice"
    ),
    "audio": _refuse(lambda v: v is not None, "audio output is not supported"),
    "modalities": _refuse(
        lambda v: v not in (None, ["text"]), "modalities other than [text] are not supported"
    ),
    "prediction": _refuse(lambda v: v is not None, "prediction is not supported"),
    "reasoning_effort": _refuse(lambda v: v is not None, "reasoning_effort is not supported"),
    "verbosity": _refuse(lambda v: v is not None, "verbosity is not supported"),
    "web_search_options": _refuse(lambda v: v is not None, "web_search_options is not supported"),
    "moderation": _refuse(lambda v: v is not None, "moderation is not supported"),
    "echo": _refuse(_set, "echo is not supported for chat"),
    "add_special_tokens": _refuse(_set, "add_special_tokens: true is not supported for chat"),
    "documents": _refuse(lambda v: v is not None, "documents is not supported"),
    "chat_template": _refuse(lambda v: v is not None, "a custom chat_template is not supported"),
    "chat_template_kwargs": _refuse(_set, "chat_template_kwargs is not supported"),
    "mm_processor_kwargs": _refuse(lambda v: v is not None, "mm_processor_kwargs is not supported"),
}
_REFUSED_COMPLETION = {
    "suffix": _refuse(_set, "suffix is not supported"),
}


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
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, FiniteFloat] | None = Field(default=None, max_length=1024)
    # Identifiers and cache hints: accepted, no effect on the output (the prefix cache
    # is automatic). `user` and `safety_identifier` appear in no log.
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    # adaserve extras
    tpot_slo_ms: FiniteFloat | None = Field(default=None, gt=0.0, le=3_600_000.0)
    ttft_slo_ms: FiniteFloat | None = Field(default=None, gt=0.0, le=3_600_000.0)
    slo_class: str | None = Field(default=None, min_length=1, max_length=64)
    # vLLM extras
    priority: int = Field(default=0, ge=-_INT32_MAX, le=_INT32_MAX)
    request_id: str | None = None
    timeout: FiniteFloat | None = Field(default=None, gt=0.0, le=86_400.0)
    speculation: SpeculationOptions | None = None
    repetition_penalty: FiniteFloat | None = Field(default=None, gt=0.0, le=10.0)
    min_p: FiniteFloat | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0, le=_INT32_MAX)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        default=None, max_length=64
    )
    allowed_token_ids: list[TokenId] | None = Field(default=None, max_length=65536)
    return_tokens_as_token_ids: bool = False
    # vLLM: the prompt's logprobs and the top k at each position (gateway.spec checks
    # the bound, naming the server's limit)
    prompt_logprobs: int | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1
    )
    guided_grammar: str | None = Field(default=None, min_length=1)
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's on chat; vLLM honours it on /v1/completions too (the same grammar).
    response_format: ResponseFormat | None = None
    # Known and refused when set (see _REFUSED_COMMON); typed loosely so that the
    # refusal, not a type error, is what the client reads.
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    REFUSED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = _REFUSED_COMMON

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

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # OpenAI and vLLM refuse it too: without a stream its include_usage would do
        # nothing, and a field that changes nothing is not dropped without a word.
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, v: str | None) -> str | None:
        if v is not None and not REQUEST_ID_RE.match(v):
            raise ValueError("request_id must be 1-128 characters of [A-Za-z0-9._:-]")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit() or int(key) > _INT32_MAX:
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    def refusal(self) -> tuple[str, str] | None:
        """(field, why) of the first feature set here that adaserve does not offer."""
        for name, (asked, why) in self.REFUSED.items():
            if asked(getattr(self, name)):
                return name, why
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                return "structured_outputs.structural_tag", "structural_tag is not supported"
            if so.whitespace_pattern is not None:
                return (
                    "structured_outputs.whitespace_pattern",
                    "whitespace_pattern is not supported",
                )
        opts = self.stream_options
        if opts is not None and opts.continuous_usage_stats:
            return (
                "stream_options.continuous_usage_stats",
                "continuous_usage_stats is not supported",
            )
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # 0 with echo (vLLM): the prompt alone (and its logprobs), nothing generated
    max_tokens: int | None = Field(default=None, ge=0, le=_INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=128)
    suffix: Any = None

    REFUSED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_REFUSED_COMMON,
        **_REFUSED_COMPLETION,
    }

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> list[str] | list[list[int]]:
        """Always a list of prompts: each a string or a list of token ids."""
        if isinstance(v, str):
            return [v]
        if not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v[0], int):
            return [v]
        if any(isinstance(p, list) and not p for p in v):
            raise ValueError("prompt must not contain an empty list of token ids")
        return v

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 (nothing generated) needs echo: true")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = Field(default=None, max_length=128)  # tool: which call
    refusal: str | None = None  # assistant: OpenAI echoes it back; kept as text

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        # Before the union is tried: an image or audio part would otherwise be reported
        # as "content.str: Input should be a valid string", which names neither.
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported: the served "
                        "models take text only (parts of type 'text')"
                    )
        return content

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or self.refusal or ""

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are for assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    prompt_cache_retention: str | None = Field(default=None, max_length=32)  # a hint
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    echo: Any = None
    add_special_tokens: Any = None
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    mm_processor_kwargs: Any = None

    REFUSED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_REFUSED_COMMON,
        **_REFUSED_CHAT,
    }

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                    "among tools"
                )
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice required needs tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages (rendered with the chat template)."""

    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    # Fewer than chat's 4096: a body one over the bound stays under the body-size
    # limit, so the schema's bound answers 400 (not the size limit's 413).
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=1024)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        return self


class DetokenizeRequest(_Body):
    model: str | None = Field(default=None, max_length=256)
    tokens: list[TokenId] = Field(max_length=1_000_000)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error the gateway returns, as the OpenAI API shapes it."""

    error: ErrorDetail
