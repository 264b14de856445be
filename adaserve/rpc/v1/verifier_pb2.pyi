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
    __slots__ = ("role", "content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "token_ids", "sampling", "tpot_slo_ms", "slo_class", "priority", "timeout_s", "client_request_id", "ttft_slo_ms", "prefix_keys", "speculation_method")
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
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tpot_slo_ms: _Optional[float] = ..., slo_class: _Optional[str] = ..., priority: _Optional[int] = ..., timeout_s: _Optional[float] = ..., client_request_id: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ..., prefix_keys: _Optional[_Iterable[int]] = ..., speculation_method: _Optional[_Union[SpeculationMethod, str]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "num_prompt_tokens", "num_generated", "ttft_ms", "tpot_slo_ms", "slo_class", "best_effort", "error", "server_elapsed_ms", "slo_floor_ms", "best_effort_reason", "ttft_slo_ms")
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
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ..., slo_class: _Optional[str] = ..., best_effort: _Optional[bool] = ..., error: _Optional[str] = ..., server_elapsed_ms: _Optional[float] = ..., slo_floor_ms: _Optional[float] = ..., best_effort_reason: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("served_model_name", "max_model_len", "baseline_tpot_ms", "slo_classes", "default_slo_class", "tp", "speculative", "vocab_size", "eos_token_ids", "slo_floor_ms", "slo_class_ttft_ms", "speculation_methods")
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
    def __init__(self, served_model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., baseline_tpot_ms: _Optional[float] = ..., slo_classes: _Optional[_Mapping[str, float]] = ..., default_slo_class: _Optional[str] = ..., tp: _Optional[int] = ..., speculative: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., slo_floor_ms: _Optional[float] = ..., slo_class_ttft_ms: _Optional[_Mapping[str, float]] = ..., speculation_methods: _Optional[_Iterable[str]] = ...) -> None: ...

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
