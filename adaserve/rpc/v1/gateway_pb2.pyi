from adaserve.rpc.v1 import verifier_pb2 as _verifier_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestOptions(_message.Message):
    __slots__ = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "tpot_slo_ms", "slo_class", "priority", "request_id", "timeout_s", "ttft_slo_ms", "speculation_method")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_METHOD_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    tpot_slo_ms: float
    slo_class: str
    priority: int
    request_id: str
    timeout_s: float
    ttft_slo_ms: float
    speculation_method: _verifier_pb2.SpeculationMethod
    def __init__(self, model: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., tpot_slo_ms: _Optional[float] = ..., slo_class: _Optional[str] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., timeout_s: _Optional[float] = ..., ttft_slo_ms: _Optional[float] = ..., speculation_method: _Optional[_Union[_verifier_pb2.SpeculationMethod, str]] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("options", "text", "token_ids")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    options: RequestOptions
    text: str
    token_ids: _verifier_pb2.TokenIds
    def __init__(self, options: _Optional[_Union[RequestOptions, _Mapping]] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_verifier_pb2.TokenIds, _Mapping]] = ...) -> None: ...

class ChatCompleteRequest(_message.Message):
    __slots__ = ("options", "messages")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    options: RequestOptions
    messages: _containers.RepeatedCompositeFieldContainer[_verifier_pb2.ChatMessage]
    def __init__(self, options: _Optional[_Union[RequestOptions, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_verifier_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class CompletionChunk(_message.Message):
    __slots__ = ("id", "model", "token_ids", "text", "finish_reason", "usage", "best_effort", "tpot_slo_ms", "slo_floor_ms", "best_effort_reason", "ttft_slo_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    BEST_EFFORT_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_FLOOR_MS_FIELD_NUMBER: _ClassVar[int]
    BEST_EFFORT_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _verifier_pb2.FinishReason
    usage: Usage
    best_effort: bool
    tpot_slo_ms: float
    slo_floor_ms: float
    best_effort_reason: str
    ttft_slo_ms: float
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_verifier_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., best_effort: _Optional[bool] = ..., tpot_slo_ms: _Optional[float] = ..., slo_floor_ms: _Optional[float] = ..., best_effort_reason: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[str]] = ...) -> None: ...
