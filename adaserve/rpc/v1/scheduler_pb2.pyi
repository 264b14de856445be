from adaserve.rpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectionPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SELECTION_POLICY_UNSPECIFIED: _ClassVar[SelectionPolicy]
    SELECTION_POLICY_ADASERVE: _ClassVar[SelectionPolicy]
    SELECTION_POLICY_EQUAL: _ClassVar[SelectionPolicy]
    SELECTION_POLICY_GLOBAL: _ClassVar[SelectionPolicy]
    SELECTION_POLICY_OPTIMAL: _ClassVar[SelectionPolicy]
    SELECTION_POLICY_PAPER: _ClassVar[SelectionPolicy]

class RequestOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_ORDER_UNSPECIFIED: _ClassVar[RequestOrder]
    REQUEST_ORDER_DESCENDING_A: _ClassVar[RequestOrder]
    REQUEST_ORDER_ASCENDING_A: _ClassVar[RequestOrder]
SELECTION_POLICY_UNSPECIFIED: SelectionPolicy
SELECTION_POLICY_ADASERVE: SelectionPolicy
SELECTION_POLICY_EQUAL: SelectionPolicy
SELECTION_POLICY_GLOBAL: SelectionPolicy
SELECTION_POLICY_OPTIMAL: SelectionPolicy
SELECTION_POLICY_PAPER: SelectionPolicy
REQUEST_ORDER_UNSPECIFIED: RequestOrder
REQUEST_ORDER_DESCENDING_A: RequestOrder
REQUEST_ORDER_ASCENDING_A: RequestOrder

class SelectRequest(_message.Message):
    __slots__ = ("requests", "trees", "budget", "depth", "t_spec_ms", "policy", "n_max", "order")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    T_SPEC_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    N_MAX_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    requests: _common_pb2.RequestProgressBatch
    trees: _common_pb2.CandidateTreeBatch
    budget: int
    depth: int
    t_spec_ms: float
    policy: SelectionPolicy
    n_max: int
    order: RequestOrder
    def __init__(self, requests: _Optional[_Union[_common_pb2.RequestProgressBatch, _Mapping]] = ..., trees: _Optional[_Union[_common_pb2.CandidateTreeBatch, _Mapping]] = ..., budget: _Optional[int] = ..., depth: _Optional[int] = ..., t_spec_ms: _Optional[float] = ..., policy: _Optional[_Union[SelectionPolicy, str]] = ..., n_max: _Optional[int] = ..., order: _Optional[_Union[RequestOrder, str]] = ...) -> None: ...

class SelectResponse(_message.Message):
    __slots__ = ("selection", "timing")
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    selection: _common_pb2.Selection
    timing: _common_pb2.ServerTiming
    def __init__(self, selection: _Optional[_Union[_common_pb2.Selection, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.ServerTiming, _Mapping]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("n", "budget")
    N_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    n: int
    budget: int
    def __init__(self, n: _Optional[int] = ..., budget: _Optional[int] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("depth", "width")
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    depth: int
    width: int
    def __init__(self, depth: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...
