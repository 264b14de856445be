from adaserve.rpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HiddenDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HIDDEN_DTYPE_UNSPECIFIED: _ClassVar[HiddenDtype]
    HIDDEN_DTYPE_FLOAT16: _ClassVar[HiddenDtype]
    HIDDEN_DTYPE_FLOAT32: _ClassVar[HiddenDtype]
HIDDEN_DTYPE_UNSPECIFIED: HiddenDtype
HIDDEN_DTYPE_FLOAT16: HiddenDtype
HIDDEN_DTYPE_FLOAT32: HiddenDtype

class DraftUpdate(_message.Message):
    __slots__ = ("id", "new_tokens", "total_len", "ingest", "hidden", "hidden_rows", "hidden_cols", "hidden_dtype")
    ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LEN_FIELD_NUMBER: _ClassVar[int]
    INGEST_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_COLS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    id: str
    new_tokens: bytes
    total_len: int
    ingest: bool
    hidden: bytes
    hidden_rows: int
    hidden_cols: int
    hidden_dtype: HiddenDtype
    def __init__(self, id: _Optional[str] = ..., new_tokens: _Optional[bytes] = ..., total_len: _Optional[int] = ..., ingest: _Optional[bool] = ..., hidden: _Optional[bytes] = ..., hidden_rows: _Optional[int] = ..., hidden_cols: _Optional[int] = ..., hidden_dtype: _Optional[_Union[HiddenDtype, str]] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("updates", "depth", "width", "stop_prob")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    STOP_PROB_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DraftUpdate]
    depth: int
    width: int
    stop_prob: float
    def __init__(self, updates: _Optional[_Iterable[_Union[DraftUpdate, _Mapping]]] = ..., depth: _Optional[int] = ..., width: _Optional[int] = ..., stop_prob: _Optional[float] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("trees", "lost_ids", "timing")
    TREES_FIELD_NUMBER: _ClassVar[int]
    LOST_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    trees: _common_pb2.CandidateTreeBatch
    lost_ids: _containers.RepeatedScalarFieldContainer[str]
    timing: _common_pb2.ServerTiming
    def __init__(self, trees: _Optional[_Union[_common_pb2.CandidateTreeBatch, _Mapping]] = ..., lost_ids: _Optional[_Iterable[str]] = ..., timing: _Optional[_Union[_common_pb2.ServerTiming, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_sequences", "kv_usage", "kind", "feature_layers", "feature_dim")
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    kv_usage: float
    kind: str
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    feature_dim: int
    def __init__(self, num_sequences: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kind: _Optional[str] = ..., feature_layers: _Optional[_Iterable[int]] = ..., feature_dim: _Optional[int] = ...) -> None: ...
