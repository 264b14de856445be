from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_METHOD_UNSPECIFIED: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_AUTO: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_MODEL: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_EAGLE: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_NGRAM: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_NONE: _ClassVar[SpeculationMethod]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TIMEOUT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
SPECULATION_METHOD_UNSPECIFIED: SpeculationMethod
SPECULATION_METHOD_AUTO: SpeculationMethod
SPECULATION_METHOD_MODEL: SpeculationMethod
SPECULATION_METHOD_EAGLE: SpeculationMethod
SPECULATION_METHOD_NGRAM: SpeculationMethod
SPECULATION_METHOD_NONE: SpeculationMethod
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TIMEOUT: FinishReason
FINISH_REASON_ERROR: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "continue_final_message", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    tools_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., tools_json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens", "bad_words", "allowed_token_ids", "logprobs", "structured_output", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    min_tokens: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    structured_output: StructuredOutput
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "field")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    field: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "token_ids", "sampling", "tpot_slo_ms", "slo_class", "priority", "timeout_s", "client_request_id", "ttft_slo_ms", "prefix_keys", "speculation_method", "n", "echo")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_METHOD_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: ChatMessages
    token_ids: TokenIds
    sampling: SamplingParams
    tpot_slo_ms: float
    slo_class: str
    priority: int
    timeout_s: float
    client_request_id: str
    ttft_slo_ms: float
    prefix_keys: _containers.RepeatedScalarFieldContainer[int]
    speculation_method: SpeculationMethod
    n: int
    echo: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tpot_slo_ms: _Optional[float] = ..., slo_class: _Optional[str] = ..., priority: _Optional[int] = ..., timeout_s: _Optional[float] = ..., client_request_id: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ..., prefix_keys: _Optional[_Iterable[int]] = ..., speculation_method: _Optional[_Union[SpeculationMethod, str]] = ..., n: _Optional[int] = ..., echo: _Optional[bool] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "num_prompt_tokens", "num_generated", "ttft_ms", "tpot_slo_ms", "slo_class", "best_effort", "error", "server_elapsed_ms", "slo_floor_ms", "best_effort_reason", "ttft_slo_ms", "index", "logprobs", "prompt_text", "prompt_logprobs", "prompt_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    BEST_EFFORT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVER_ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_FLOOR_MS_FIELD_NUMBER: _ClassVar[int]
    BEST_EFFORT_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated: int
    ttft_ms: float
    tpot_slo_ms: float
    slo_class: str
    best_effort: bool
    error: str
    server_elapsed_ms: float
    slo_floor_ms: float
    best_effort_reason: str
    ttft_slo_ms: float
    index: int
    logprobs: TokenLogprobs
    prompt_text: str
    prompt_logprobs: TokenLogprobs
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ..., slo_class: _Optional[str] = ..., best_effort: _Optional[bool] = ..., error: _Optional[str] = ..., server_elapsed_ms: _Optional[float] = ..., slo_floor_ms: _Optional[float] = ..., best_effort_reason: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., prompt_text: _Optional[str] = ..., prompt_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs", "top_k", "top_token_ids", "top_logprobs", "pieces", "ranks")
    class PiecesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    logprobs: bytes
    top_k: int
    top_token_ids: bytes
    top_logprobs: bytes
    pieces: _containers.ScalarMap[int, str]
    ranks: bytes
    def __init__(self, logprobs: _Optional[bytes] = ..., top_k: _Optional[int] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., pieces: _Optional[_Mapping[int, str]] = ..., ranks: _Optional[bytes] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids", "max_model_len", "pieces")
    IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    pieces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., pieces: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("served_model_name", "max_model_len", "baseline_tpot_ms", "slo_classes", "default_slo_class", "tp", "speculative", "vocab_size", "eos_token_ids", "slo_floor_ms", "slo_class_ttft_ms", "speculation_methods", "tool_call_format", "quantization", "baseline")
    class SloClassesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class SloClassTtftMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BASELINE_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASSES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SLO_FLOOR_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_METHODS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    max_model_len: int
    baseline_tpot_ms: float
    slo_classes: _containers.ScalarMap[str, float]
    default_slo_class: str
    tp: int
    speculative: bool
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    slo_floor_ms: float
    slo_class_ttft_ms: _containers.ScalarMap[str, float]
    speculation_methods: _containers.RepeatedScalarFieldContainer[str]
    tool_call_format: str
    quantization: str
    baseline: BaselineInfo
    def __init__(self, served_model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., baseline_tpot_ms: _Optional[float] = ..., slo_classes: _Optional[_Mapping[str, float]] = ..., default_slo_class: _Optional[str] = ..., tp: _Optional[int] = ..., speculative: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., slo_floor_ms: _Optional[float] = ..., slo_class_ttft_ms: _Optional[_Mapping[str, float]] = ..., speculation_methods: _Optional[_Iterable[str]] = ..., tool_call_format: _Optional[str] = ..., quantization: _Optional[str] = ..., baseline: _Optional[_Union[BaselineInfo, _Mapping]] = ...) -> None: ...

class BaselineInfo(_message.Message):
    __slots__ = ("source", "measured_at", "load_1m", "cores", "settled", "recalibrations")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    LOAD_1M_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    RECALIBRATIONS_FIELD_NUMBER: _ClassVar[int]
    source: str
    measured_at: float
    load_1m: float
    cores: int
    settled: bool
    recalibrations: int
    def __init__(self, source: _Optional[str] = ..., measured_at: _Optional[float] = ..., load_1m: _Optional[float] = ..., cores: _Optional[int] = ..., settled: _Optional[bool] = ..., recalibrations: _Optional[int] = ...) -> None: ...

class VerifierStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierStatsResponse(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage", "num_requests", "iterations", "drafter_healthy", "scheduler_healthy")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    num_requests: int
    iterations: int
    drafter_healthy: bool
    scheduler_healthy: bool
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_requests: _Optional[int] = ..., iterations: _Optional[int] = ..., drafter_healthy: _Optional[bool] = ..., scheduler_healthy: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: float
    def __init__(self, interval_ms: _Optional[float] = ...) -> None: ...

class BatchTpot(_message.Message):
    __slots__ = ("batch_size", "tpot_ms")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    tpot_ms: float
    def __init__(self, batch_size: _Optional[int] = ..., tpot_ms: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("running", "waiting", "max_running", "kv_usage", "tpot_curve", "tightest_slo_ms", "prefill_queue_tokens", "prefill_ms_per_token", "draining", "loop_age_ms", "prefix_keys", "prefix_reset", "prefix_capacity")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    TPOT_CURVE_FIELD_NUMBER: _ClassVar[int]
    TIGHTEST_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOOP_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_RESET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    max_running: int
    kv_usage: float
    tpot_curve: _containers.RepeatedCompositeFieldContainer[BatchTpot]
    tightest_slo_ms: float
    prefill_queue_tokens: int
    prefill_ms_per_token: float
    draining: bool
    loop_age_ms: float
    prefix_keys: _containers.RepeatedScalarFieldContainer[int]
    prefix_reset: bool
    prefix_capacity: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_running: _Optional[int] = ..., kv_usage: _Optional[float] = ..., tpot_curve: _Optional[_Iterable[_Union[BatchTpot, _Mapping]]] = ..., tightest_slo_ms: _Optional[float] = ..., prefill_queue_tokens: _Optional[int] = ..., prefill_ms_per_token: _Optional[float] = ..., draining: _Optional[bool] = ..., loop_age_ms: _Optional[float] = ..., prefix_keys: _Optional[_Iterable[int]] = ..., prefix_reset: _Optional[bool] = ..., prefix_capacity: _Optional[int] = ...) -> None: ...
