from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RequestProgressBatch(_message.Message):
    __slots__ = ("ids", "tpot_slo_ms", "elapsed_ms", "decoded")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    tpot_slo_ms: bytes
    elapsed_ms: bytes
    decoded: bytes
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., tpot_slo_ms: _Optional[bytes] = ..., elapsed_ms: _Optional[bytes] = ..., decoded: _Optional[bytes] = ...) -> None: ...

class CandidateTreeBatch(_message.Message):
    __slots__ = ("sizes", "tokens", "parents", "logprobs")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sizes: bytes
    tokens: bytes
    parents: bytes
    logprobs: bytes
    def __init__(self, sizes: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., parents: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ...) -> None: ...

class Selection(_message.Message):
    __slots__ = ("sizes", "selected", "a", "a_cap", "expected_accepted", "budget_used", "invalid")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    A_CAP_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_USED_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    sizes: bytes
    selected: bytes
    a: _containers.RepeatedScalarFieldContainer[float]
    a_cap: _containers.RepeatedScalarFieldContainer[float]
    expected_accepted: _containers.RepeatedScalarFieldContainer[float]
    budget_used: int
    invalid: bool
    def __init__(self, sizes: _Optional[bytes] = ..., selected: _Optional[bytes] = ..., a: _Optional[_Iterable[float]] = ..., a_cap: _Optional[_Iterable[float]] = ..., expected_accepted: _Optional[_Iterable[float]] = ..., budget_used: _Optional[int] = ..., invalid: _Optional[bool] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("decode_us", "compute_us", "encode_us")
    DECODE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    ENCODE_US_FIELD_NUMBER: _ClassVar[int]
    decode_us: int
    compute_us: int
    encode_us: int
    def __init__(self, decode_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., encode_us: _Optional[int] = ...) -> None: ...
