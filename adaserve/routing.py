"""Routing requests across serving units: by SLO headroom, with prefix affinity.

A unit reports its load often and cheaply (`UnitLoad`, the verifier's `Load` stream;
the simulator reads its engines directly). For each request, `route` picks the unit
where its TPOT SLO is most likely met without pushing the unit's tightest running
request past its own:

    n'       = running + waiting + sent since the report + 1     (the batch it joins)
    tpot(n') = the unit's predicted TPOT at batch n' (its curve, interpolated)
    limit    = min(the request's SLO, the tightest SLO the unit already serves)
    fits     = n' <= max_running, KV below `kv_limit`, and the predicted prefill queue
               within the request's TTFT SLO (if it has one): room, a hard limit
    meets    = tpot(n') <= limit: the SLOs are predicted to hold
    headroom = limit / tpot(n')

Among the units that fit (all, if none does), only those whose n' is within
`imbalance` (2, or a quarter) of the least loaded one's compete; among those, the ones
whose SLOs hold (meets) and that hold the longest prefix of the request win (their
prefix cache saves the prefill), then the smallest n', then the most headroom. The SLO
decides where a request may go, balance where among those it goes: ranking by predicted
headroom, or letting the prediction alone pick, herds requests onto whichever unit's
prediction came out a little low (measured in the simulator: BENCHMARKS.md). With none
whose SLOs hold, the smallest n' among them, then the most headroom (`overloaded`).

A unit whose last report is older than `stale_s` is not trusted: it gets no request
while another unit reports fresh, and when none does, routing falls back to least
outstanding requests. Draining units get nothing.

This module is pure (no clock reads, no I/O): the gateway (`gateway/router.py`) and the
simulator's multi-unit driver (`sim/driver.py`) call the same `route`.

Prefix affinity is a cheap approximation of each unit's prefix cache, in the gateway's
model-free terms: a request's prefix keys are a hash chain over its chat messages (or
over fixed blocks of its text or token ids), so a follow-up turn that resends its
history shares the previous turn's keys. A unit remembers the keys of the requests it
was sent in an LRU of fixed size (`PrefixLog`) and streams every touch to its
routers, which replay them into identical mirrors. It does not see the unit's real
cache evictions; its size bounds how stale a memory it can keep.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from adaserve.latency import interp

POLICIES = ("slo", "least_outstanding")

# Chain granularity for prompts that are not chat messages.
TEXT_BLOCK_CHARS = 256
TOKEN_BLOCK = 64
# The longest chain a request contributes (a very long prompt needs no finer affinity).
MAX_KEYS = 32


@dataclass(frozen=True)
class UnitLoad:
    """What one serving unit reports about itself (wire: `verifier.proto` LoadReport)."""

    running: int  # admitted requests (decoding or being prefilled)
    waiting: int  # submitted, not yet admitted
    max_running: int
    kv_usage: float  # 0..1
    # (batch size, predicted TPOT ms of a request in a decode batch that size), by size
    tpot_curve: tuple[tuple[int, float], ...]
    tightest_slo_ms: float  # smallest TPOT SLO among its requests held to one (0: none)
    prefill_queue_tokens: int  # prompt tokens waiting for or in prefill
    prefill_ms_per_token: float
    draining: bool = False

    def tpot_ms(self, batch: int) -> float:
        """Predicted TPOT at `batch` (piecewise linear in the reported points)."""
        if not self.tpot_curve:
            return math.inf
        xs = [float(n) for n, _ in self.tpot_curve]
        ys = [ms for _, ms in self.tpot_curve]
        return interp(float(batch), xs, ys)

    @property
    def pressure(self) -> float:
        """Predicted TPOT of one more request / the tightest SLO held: above 1.0 the unit
        cannot take another request at its SLOs (the autoscaling signal). 0 when idle."""
        n = self.running + self.waiting
        if n == 0 or self.tightest_slo_ms <= 0:
            return 0.0
        return self.tpot_ms(n + 1) / self.tightest_slo_ms


@dataclass(frozen=True)
class RouteRequest:
    ttft_slo_ms: float | None = None
    prompt_tokens: int = 0  # an estimate (the gateway is model-free: characters / 4)
    prefix_keys: tuple[int, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """One unit as a router sees it for one request."""

    outstanding: int  # requests this router has in flight there
    load: UnitLoad | None  # the last report (None: never reported)
    load_age_s: float  # since that report arrived
    sent_since_report: int = 0  # requests routed there after that report was made
    tpot_slo_ms: float | None = None  # the request's TPOT SLO as this unit resolves it
    prefix_match: int = 0  # leading prefix keys of the request the unit holds
    ttft_slo_ms: float | None = None  # the unit's TTFT SLO for it (None: the request's)


class Decision(NamedTuple):
    choices: tuple[int, ...]  # indexes of equally good candidates (the caller breaks ties)
    reason: str  # prefix | slo | overloaded | least_outstanding | stale


@dataclass(frozen=True)
class RoutingParams:
    policy: str = "slo"
    stale_s: float = 1.0
    kv_limit: float = 0.95  # above this KV usage a unit preempts: not a place to add work


def route(req: RouteRequest, cands: Sequence[Candidate], params: RoutingParams) -> Decision:
    """The candidates to send `req` to (see the module docstring). `cands` non-empty."""
    if not cands:
        raise ValueError("route: no candidate units")
    live = [i for i, c in enumerate(cands) if not (c.load is not None and c.load.draining)]
    if not live:
        live = list(range(len(cands)))
    if params.policy == "least_outstanding":
        return Decision(_least_outstanding(cands, live), "least_outstanding")
    if params.policy != "slo":
        raise ValueError(f"routing policy must be one of {POLICIES}, got {params.policy!r}")
    fresh = [i for i in live if cands[i].load is not None and cands[i].load_age_s <= params.stale_s]
    if not fresh:
        return Decision(_least_outstanding(cands, live), "stale")
    scored = {i: _score(req, cands[i], params) for i in fresh}
    # Room (KV, a batch slot, the prefill queue within the TTFT SLO) is a hard limit.
    fits = [i for i in fresh if scored[i].fits] or fresh
    # Only units near the least loaded compete on predicted TPOT and prefix: past
    # capacity the units whose TPOT is predicted to hold are whichever came out a little
    # low, and sending everything there unbalances the fleet (BENCHMARKS.md, routing).
    least = min(scored[i].batch for i in fits)
    near = [i for i in fits if scored[i].batch <= least + imbalance(least)]
    feasible = [i for i in near if scored[i].meets]
    if feasible:
        best_prefix = max(cands[i].prefix_match for i in feasible)
        if best_prefix > 0:
            holders = [i for i in feasible if cands[i].prefix_match == best_prefix]
            return Decision(_best(scored, holders), "prefix")
        return Decision(_best(scored, feasible), "slo")
    return Decision(_best(scored, near), "overloaded")


def imbalance(least_batch: int) -> int:
    """How many more requests than the least loaded unit a unit may run and still be
    chosen for its SLO headroom or its prefix: 2, or a quarter of that batch."""
    return max(2, math.ceil(0.25 * least_batch))


class _Score(NamedTuple):
    fits: bool  # KV below the limit, a batch slot free, the prefill queue within TTFT
    meets: bool  # the predicted TPOT holds the request's and the unit's tightest SLO
    headroom: float
    batch: int  # the batch the request would join


def _score(req: RouteRequest, c: Candidate, params: RoutingParams) -> _Score:
    """What sending `req` to `c` (which has a load report) would do."""
    load = c.load
    assert load is not None
    batch = load.running + load.waiting + c.sent_since_report + 1
    tpot = load.tpot_ms(batch)
    limit = c.tpot_slo_ms if c.tpot_slo_ms else math.inf
    if load.tightest_slo_ms > 0:
        limit = min(limit, load.tightest_slo_ms)
    if math.isinf(limit):  # nothing to hold it to: the faster unit is the better one
        limit = 1.0
    headroom = limit / tpot if tpot > 0 else math.inf
    fits = batch <= load.max_running and load.kv_usage < params.kv_limit
    ttft = c.ttft_slo_ms if c.ttft_slo_ms is not None else req.ttft_slo_ms
    if ttft is not None:
        queue_ms = (load.prefill_queue_tokens + req.prompt_tokens) * load.prefill_ms_per_token
        fits = fits and queue_ms <= ttft
    return _Score(fits, tpot <= limit, headroom, batch)


def _best(scored: dict[int, _Score], among: list[int]) -> tuple[int, ...]:
    """The smallest batch, then the most headroom."""
    smallest = min(scored[i].batch for i in among)
    band = [i for i in among if scored[i].batch == smallest]
    best = max(scored[i].headroom for i in band)
    # Relative tolerance: two units whose predictions differ by rounding are a tie.
    return tuple(i for i in band if scored[i].headroom >= best * (1 - 1e-9))


def _least_outstanding(cands: Sequence[Candidate], among: list[int]) -> tuple[int, ...]:
    least = min(cands[i].outstanding for i in among)
    return tuple(i for i in among if cands[i].outstanding == least)


# ---- prefix keys --------------------------------------------------------------------


def _chain(kind: bytes, items: Iterable[bytes]) -> tuple[int, ...]:
    """64-bit hash chain: key i identifies items[0..i] (so equal keys, equal prefixes)."""
    keys: list[int] = []
    prev = kind
    for item in items:
        if len(keys) == MAX_KEYS:
            break
        h = hashlib.blake2b(prev + b"\x00" + item, digest_size=8).digest()
        keys.append(int.from_bytes(h, "little"))
        prev = h
    return tuple(keys)


def message_keys(messages: Sequence[tuple[str, str]]) -> tuple[int, ...]:
    """One key per (role, content) message: a follow-up turn that resends its history
    shares the keys of the turn before (its prompt ends where that turn's reply starts)."""
    return _chain(b"chat", (f"{role}\x00{content}".encode() for role, content in messages))


def text_keys(text: str) -> tuple[int, ...]:
    """One key per full block of TEXT_BLOCK_CHARS characters."""
    n = len(text) // TEXT_BLOCK_CHARS
    blocks = (text[i * TEXT_BLOCK_CHARS : (i + 1) * TEXT_BLOCK_CHARS] for i in range(n))
    return _chain(b"text", (b.encode() for b in blocks))


def token_keys(ids: Sequence[int]) -> tuple[int, ...]:
    """One key per full block of TOKEN_BLOCK token ids."""
    n = len(ids) // TOKEN_BLOCK
    blocks = (ids[i * TOKEN_BLOCK : (i + 1) * TOKEN_BLOCK] for i in range(n))
    return _chain(b"ids", (",".join(map(str, b)).encode() for b in blocks))


def match_depth(keys: Sequence[int], held: PrefixMirror | PrefixLog) -> int:
    """How many leading keys of a request `held` has (the longest shared prefix)."""
    for depth in range(len(keys), 0, -1):
        if keys[depth - 1] in held:
            return depth
    return 0


class PrefixMirror:
    """An LRU set of prefix keys of fixed capacity. Replaying the same touches in the
    same order gives the same set: a router's mirror of a unit's `PrefixLog`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"prefix key capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def touch(self, keys: Iterable[int]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
            if len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[int]:
        """Oldest first: touching them in this order rebuilds the same LRU."""
        return list(self._keys)


class PrefixLog(PrefixMirror):
    """A unit's own LRU of prefix keys, plus the sequence of touches its report streams
    read from: `since(cursor)` gives the touches a reader has not seen, or, if it fell
    further behind than the log keeps, the whole set with `reset` set."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._log: deque[int] = deque(maxlen=2 * capacity)
        self._seq = 0  # touches ever made; the log holds the last len(_log) of them

    def touch(self, keys: Iterable[int]) -> None:
        keys = list(keys)
        super().touch(keys)
        self._log.extend(keys)
        self._seq += len(keys)

    def since(self, cursor: int | None) -> tuple[list[int], bool, int]:
        """(keys to touch, reset first?, the new cursor) for a reader at `cursor`
        (None: a new reader, which gets the whole set)."""
        behind = self._seq - (cursor or 0)
        if cursor is None or behind > len(self._log) or behind < 0:
            return self.keys(), True, self._seq
        return list(self._log)[len(self._log) - behind :], False, self._seq
