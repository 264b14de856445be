"""Protobuf <-> domain values, for every service and client.

Arrays cross the wire as packed little-endian bytes: encoding is one `tobytes` per
buffer and decoding one `np.frombuffer`, whatever the batch size. Structural checks
that only the wire format can get wrong (byte lengths, enum values, counts) live here;
everything else is the domain's to validate, with messages that name the field.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from adaserve.drafter import DraftUpdate
from adaserve.request import FINISH_REASONS, SPECULATION_METHODS, TokenLogprobs
from adaserve.routing import UnitLoad
from adaserve.rpc.v1 import common_pb2, drafter_pb2, scheduler_pb2, verifier_pb2
from adaserve.selection import (
    ORDERS,
    POLICIES,
    ProgressBatch,
    RequestProgress,
    Selection,
    SelectionParams,
)
from adaserve.tree import CandidateTree, TreeBatch

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
F64 = np.dtype("<f8")
F32 = np.dtype("<f4")

_POLICY_TO_PB = {
    "adaserve": scheduler_pb2.SELECTION_POLICY_ADASERVE,
    "paper": scheduler_pb2.SELECTION_POLICY_PAPER,
    "equal": scheduler_pb2.SELECTION_POLICY_EQUAL,
    "global": scheduler_pb2.SELECTION_POLICY_GLOBAL,
    "optimal": scheduler_pb2.SELECTION_POLICY_OPTIMAL,
}
_POLICY_FROM_PB = {v: k for k, v in _POLICY_TO_PB.items()}
_ORDER_TO_PB = {
    "descending_a": scheduler_pb2.REQUEST_ORDER_DESCENDING_A,
    "ascending_a": scheduler_pb2.REQUEST_ORDER_ASCENDING_A,
}
_ORDER_FROM_PB = {v: k for k, v in _ORDER_TO_PB.items()}
assert set(_POLICY_TO_PB) == set(POLICIES) and set(_ORDER_TO_PB) == set(ORDERS)


_FINISH_TO_PB = {
    None: verifier_pb2.FINISH_REASON_UNSPECIFIED,  # still running
    "stop": verifier_pb2.FINISH_REASON_STOP,
    "length": verifier_pb2.FINISH_REASON_LENGTH,
    "abort": verifier_pb2.FINISH_REASON_ABORT,
    "timeout": verifier_pb2.FINISH_REASON_TIMEOUT,
    "error": verifier_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
assert set(_FINISH_TO_PB) == {None, *FINISH_REASONS}


_METHOD_TO_PB = {
    None: verifier_pb2.SPECULATION_METHOD_UNSPECIFIED,  # the class's, else the default
    "auto": verifier_pb2.SPECULATION_METHOD_AUTO,
    "model": verifier_pb2.SPECULATION_METHOD_MODEL,
    "eagle": verifier_pb2.SPECULATION_METHOD_EAGLE,
    "ngram": verifier_pb2.SPECULATION_METHOD_NGRAM,
    "none": verifier_pb2.SPECULATION_METHOD_NONE,
}
_METHOD_FROM_PB = {v: k for k, v in _METHOD_TO_PB.items()}
assert set(_METHOD_TO_PB) == {None, *SPECULATION_METHODS}


def speculation_method_to_pb(method: str | None) -> int:
    return _METHOD_TO_PB[method]


def speculation_method_from_pb(value: int) -> str | None:
    """The method a request asks for (None: unspecified); WireError naming the field
    for a value this build does not know."""
    try:
        return _METHOD_FROM_PB[value]
    except KeyError:
        raise WireError(f"speculation.method: unknown enum value {value}") from None


class WireError(ValueError):
    """A message that cannot be a valid request; the text names the field."""


def packed(values: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def unpacked(buf: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    """A read-only view of `buf`; raises WireError naming `field` on a ragged length."""
    if len(buf) % dtype.itemsize:
        raise WireError(
            f"{field}: {len(buf)} bytes is not a whole number of {dtype.itemsize}-byte values"
        )
    return np.frombuffer(buf, dtype=dtype)


# ---- finish reasons -------------------------------------------------------------------


def finish_reason_to_pb(reason: str | None) -> int:
    """The wire enum of an engine finish reason (None: the stream goes on)."""
    return _FINISH_TO_PB[reason]


def finish_reason_from_pb(value: int) -> str | None:
    """The finish reason of a wire enum: None for UNSPECIFIED (the stream goes on); a
    value this build does not know (a newer server) reads as "error"."""
    return _FINISH_FROM_PB.get(value, "error")


# ---- logprobs -------------------------------------------------------------------------


def logprobs_to_pb(lp: TokenLogprobs, pieces: dict[int, str]) -> verifier_pb2.TokenLogprobs:
    return verifier_pb2.TokenLogprobs(
        logprobs=packed(lp.logprobs, F32),
        top_k=int(lp.top_ids.shape[1]),
        top_token_ids=packed(lp.top_ids, I32),
        top_logprobs=packed(lp.top_logprobs, F32),
        pieces=pieces,
        ranks=b"" if lp.ranks is None else packed(lp.ranks, I32),
    )


def logprobs_from_pb(
    msg: verifier_pb2.TokenLogprobs, n: int, field: str = "logprobs"
) -> TokenLogprobs:
    """The log-probabilities of a chunk of `n` tokens (ranks where the message has
    them); WireError naming `field` on a ragged message."""
    lp = unpacked(msg.logprobs, F32, f"{field}.logprobs")
    ids = unpacked(msg.top_token_ids, I32, f"{field}.top_token_ids")
    top = unpacked(msg.top_logprobs, F32, f"{field}.top_logprobs")
    k = msg.top_k
    if lp.shape[0] != n or k < 0 or ids.shape[0] != n * k or top.shape[0] != n * k:
        raise WireError(f"{field}: {lp.shape[0]} values and top_k {k} for {n} tokens")
    ranks = None
    if msg.ranks:
        ranks = unpacked(msg.ranks, I32, f"{field}.ranks")
        if ranks.shape[0] != n:
            raise WireError(f"{field}: {ranks.shape[0]} ranks for {n} tokens")
    return TokenLogprobs(lp, ids.reshape(n, k), top.reshape(n, k), ranks)


# ---- trees ----------------------------------------------------------------------------


def trees_to_pb(trees: TreeBatch | Sequence[CandidateTree]) -> common_pb2.CandidateTreeBatch:
    batch = trees if isinstance(trees, TreeBatch) else TreeBatch.from_trees(trees)
    return common_pb2.CandidateTreeBatch(
        sizes=packed(batch.sizes, I32),
        tokens=packed(batch.tokens, I32),
        parents=packed(batch.parents, I32),
        logprobs=packed(batch.logprobs, F32),
    )


def trees_from_pb(msg: common_pb2.CandidateTreeBatch) -> TreeBatch:
    """Zero-copy views over the message's buffers. Checks lengths only; the tree
    structure is validated by whoever consumes the batch (select does)."""
    return TreeBatch.from_buffers(msg.tokens, msg.parents, msg.logprobs, msg.sizes)


# ---- selection requests ---------------------------------------------------------------


def progress_to_pb(requests: Sequence[RequestProgress]) -> common_pb2.RequestProgressBatch:
    if isinstance(requests, ProgressBatch):
        ids, tpot, elapsed, decoded = (
            requests.ids,
            requests.tpot_slo_ms,
            requests.elapsed_ms,
            requests.decoded,
        )
    else:
        n = len(requests)
        try:
            ids = [r.id for r in requests]
            tpot = np.fromiter((r.tpot_slo_ms for r in requests), F64, n)
            elapsed = np.fromiter((r.elapsed_ms for r in requests), F64, n)
            decoded = np.fromiter((r.decoded for r in requests), I64, n)
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ValueError(
                f"requests: each needs an id and numeric tpot_slo_ms, elapsed_ms, decoded ({exc})"
            ) from None
    return common_pb2.RequestProgressBatch(
        ids=ids,
        tpot_slo_ms=packed(tpot, F64),
        elapsed_ms=packed(elapsed, F64),
        decoded=packed(decoded, I64),
    )


def progress_from_pb(msg: common_pb2.RequestProgressBatch) -> ProgressBatch:
    """Views over the message's buffers; the ids stay the message's own container."""
    return ProgressBatch(
        msg.ids,
        unpacked(msg.tpot_slo_ms, F64, "requests.tpot_slo_ms"),
        unpacked(msg.elapsed_ms, F64, "requests.elapsed_ms"),
        unpacked(msg.decoded, I64, "requests.decoded"),
    )


def select_request_to_pb(
    requests: Sequence[RequestProgress],
    trees: TreeBatch | Sequence[CandidateTree],
    params: SelectionParams,
) -> scheduler_pb2.SelectRequest:
    if params.policy not in _POLICY_TO_PB:
        raise ValueError(f"policy: {params.policy!r} is not one of {', '.join(POLICIES)}")
    if params.order not in _ORDER_TO_PB:
        raise ValueError(f"order: {params.order!r} is not one of {', '.join(ORDERS)}")
    return scheduler_pb2.SelectRequest(
        requests=progress_to_pb(requests),
        trees=trees_to_pb(trees),
        budget=params.budget,
        depth=params.depth,
        t_spec_ms=params.t_spec_ms,
        policy=_POLICY_TO_PB[params.policy],
        n_max=params.n_max,
        order=_ORDER_TO_PB[params.order],
    )


def select_request_from_pb(
    msg: scheduler_pb2.SelectRequest, default_policy: str, default_order: str
) -> tuple[ProgressBatch, TreeBatch, SelectionParams]:
    """UNSPECIFIED policy/order mean the server's configured defaults."""
    policy = _enum(msg.policy, _POLICY_FROM_PB, default_policy, "policy")
    order = _enum(msg.order, _ORDER_FROM_PB, default_order, "order")
    params = SelectionParams(
        budget=msg.budget,
        depth=msg.depth,
        t_spec_ms=msg.t_spec_ms,
        policy=policy,
        n_max=msg.n_max if msg.HasField("n_max") else None,
        order=order,
    )
    return progress_from_pb(msg.requests), trees_from_pb(msg.trees), params


def _enum(value: int, table: dict[int, str], default: str, field: str) -> str:
    if value == 0:
        return default
    try:
        return table[value]
    except KeyError:
        raise WireError(f"{field}: unknown enum value {value}") from None


# ---- selections -----------------------------------------------------------------------


def selection_to_pb(s: Selection) -> common_pb2.Selection:
    sizes = np.fromiter((x.shape[0] for x in s.selected), dtype=I32, count=len(s.selected))
    flat = np.concatenate(s.selected) if s.selected else np.zeros(0, I32)
    return common_pb2.Selection(
        sizes=sizes.tobytes(),
        selected=packed(flat, I32),
        a=s.a.tolist(),
        a_cap=s.a_cap.tolist(),
        expected_accepted=np.asarray(s.expected_accepted, dtype=np.float64).tolist(),
        budget_used=s.budget_used,
        invalid=s.invalid,
    )


def selection_from_pb(msg: common_pb2.Selection) -> Selection:
    sizes = unpacked(msg.sizes, I32, "selection.sizes")
    flat = unpacked(msg.selected, I32, "selection.selected")
    ends = np.cumsum(sizes, dtype=np.int64).tolist()
    if (ends[-1] if ends else 0) != flat.shape[0]:
        raise WireError(
            f"selection: sum(sizes)={ends[-1] if ends else 0} but selected has {flat.shape[0]}"
        )
    starts = [0, *ends][:-1]
    return Selection(
        selected=[flat[s:e] for s, e in zip(starts, ends, strict=True)],
        a=np.array(msg.a, dtype=np.float64),
        a_cap=np.array(msg.a_cap, dtype=np.float64),
        expected_accepted=np.array(msg.expected_accepted, dtype=np.float64),
        budget_used=msg.budget_used,
        invalid=msg.invalid,
    )


# ---- drafter --------------------------------------------------------------------------


def speculate_request_to_pb(
    updates: Sequence[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
) -> drafter_pb2.SpeculateRequest:
    return drafter_pb2.SpeculateRequest(
        updates=[_draft_update_to_pb(u) for u in updates],
        depth=depth,
        width=width,
        stop_prob=stop_prob,
    )


# Feature rows on the wire (DraftUpdate.hidden): little-endian, as the engine keeps them.
_HIDDEN_TO_PB = {
    np.dtype(np.float16): drafter_pb2.HIDDEN_DTYPE_FLOAT16,
    np.dtype(np.float32): drafter_pb2.HIDDEN_DTYPE_FLOAT32,
}
_HIDDEN_FROM_PB = {v: k.newbyteorder("<") for k, v in _HIDDEN_TO_PB.items()}


def _draft_update_to_pb(u: DraftUpdate) -> drafter_pb2.DraftUpdate:
    msg = drafter_pb2.DraftUpdate(
        id=u.id, new_tokens=packed(u.new_tokens, I32), total_len=u.total_len, ingest=u.ingest
    )
    if u.hidden is not None:
        dtype = np.dtype(u.hidden.dtype)
        if dtype not in _HIDDEN_TO_PB or u.hidden.ndim != 2:
            raise ValueError(f"hidden of {u.id!r}: float16 or float32 [k, F*H], got {dtype}")
        msg.hidden = packed(u.hidden, _HIDDEN_FROM_PB[_HIDDEN_TO_PB[dtype]])
        msg.hidden_rows, msg.hidden_cols = u.hidden.shape
        msg.hidden_dtype = _HIDDEN_TO_PB[dtype]
    return msg


def hidden_from_pb(u: drafter_pb2.DraftUpdate, field: str) -> np.ndarray | None:
    """A DraftUpdate's feature rows ([rows, cols] view), None where it sent none;
    WireError where the payload and its shape and dtype disagree (the drafter checks
    them against its tokens and its feature size)."""
    if not u.hidden and u.hidden_dtype == drafter_pb2.HIDDEN_DTYPE_UNSPECIFIED:
        if u.hidden_rows or u.hidden_cols:
            raise WireError(f"{field}: a shape but no hidden_dtype")
        return None
    dtype = _HIDDEN_FROM_PB.get(u.hidden_dtype)
    if dtype is None:
        raise WireError(f"{field}: unknown hidden_dtype {u.hidden_dtype}")
    if u.hidden_rows < 0 or u.hidden_cols < 0:
        raise WireError(f"{field}: negative shape [{u.hidden_rows}, {u.hidden_cols}]")
    want = u.hidden_rows * u.hidden_cols * dtype.itemsize
    if len(u.hidden) != want:
        raise WireError(
            f"{field}: {len(u.hidden)} bytes for [{u.hidden_rows}, {u.hidden_cols}] "
            f"{dtype.name} ({want} expected)"
        )
    return np.frombuffer(u.hidden, dtype=dtype).reshape(u.hidden_rows, u.hidden_cols)


def speculate_request_from_pb(
    msg: drafter_pb2.SpeculateRequest,
) -> tuple[list[DraftUpdate], int, int, float]:
    """Token arrays are views over the message's buffers; the drafter validates the
    rest (ids, lengths, token range, depth, width and stop_prob)."""
    updates = []
    for k, u in enumerate(msg.updates):
        if not u.id:
            raise WireError(f"updates[{k}].id: empty request id")
        tokens = unpacked(u.new_tokens, I32, f"updates[{k}].new_tokens")
        hidden = hidden_from_pb(u, f"updates[{k}].hidden")
        updates.append(DraftUpdate(u.id, tokens, u.total_len, ingest=u.ingest, hidden=hidden))
    return updates, msg.depth, msg.width, msg.stop_prob


def load_to_pb(load: UnitLoad, loop_age_s: float) -> verifier_pb2.LoadReport:
    """A unit's load report (prefix keys are the stream's to add)."""
    return verifier_pb2.LoadReport(
        running=load.running,
        waiting=load.waiting,
        max_running=load.max_running,
        kv_usage=load.kv_usage,
        tpot_curve=[verifier_pb2.BatchTpot(batch_size=n, tpot_ms=ms) for n, ms in load.tpot_curve],
        tightest_slo_ms=load.tightest_slo_ms,
        prefill_queue_tokens=load.prefill_queue_tokens,
        prefill_ms_per_token=load.prefill_ms_per_token,
        draining=load.draining,
        loop_age_ms=loop_age_s * 1000.0,
    )


def load_from_pb(msg: verifier_pb2.LoadReport) -> UnitLoad:
    """ValueError on a report routing cannot use (a curve out of order, negative
    times): the router then treats the unit as not reporting."""
    curve = tuple((p.batch_size, p.tpot_ms) for p in msg.tpot_curve)
    if any(b[0] <= a[0] for a, b in itertools.pairwise(curve)):
        raise ValueError("LoadReport.tpot_curve: batch sizes must increase")
    if any(not ms > 0 for _, ms in curve) or msg.prefill_ms_per_token < 0:
        raise ValueError("LoadReport: predicted times must be positive")
    return UnitLoad(
        running=msg.running,
        waiting=msg.waiting,
        max_running=msg.max_running,
        kv_usage=msg.kv_usage,
        tpot_curve=curve,
        tightest_slo_ms=msg.tightest_slo_ms,
        prefill_queue_tokens=msg.prefill_queue_tokens,
        prefill_ms_per_token=msg.prefill_ms_per_token,
        draining=msg.draining,
    )
