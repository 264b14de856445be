"""SLO-customized token selection (paper 000/001, Algorithm 2) and its ablations.

Given every request's progress, its candidate tree and the verifier's token budget B,
choose the nodes to verify. Every root costs one budget slot and counts 1.0 toward the
expected accepted tokens (the bonus token is always emitted).

Policies:
- `paper`: Algorithm 2 exactly. SLO phase: requests in descending A(r) (setting
  `order`), each adding its highest-f nodes until 1 + sum f >= A_cap(r), it holds n_max
  nodes (root included), or the budget is spent; throughput phase: the globally
  highest-f nodes left until the budget is spent. (The paper's loops run while B >= 0,
  one node past the budget; here the budget is a hard cap, as everywhere.)
- `adaserve`: the SLO phase, then the throughput phase (Algorithm 2 with two changes,
  benchmarks/sim/RESULTS.md). SLO phase: the requests that can reach A_cap(r) this
  iteration with at most n_max nodes (root included), in descending A(r) (setting
  `order`), each add their highest-f nodes until 1 + sum f >= A_cap(r) or the budget
  is spent; a request that cannot reach it keeps only its root here (triage: Algorithm
  2 would give it n_max nodes of low-f tails). Throughput phase: the globally
  highest-f nodes left, while each raises the expected accepted tokens per unit of
  verify time (knee cost model, `throughput_phase`), at most the rest of B.
- `equal` (EqualGreedy): B split evenly, each request greedy within its share.
- `global` (GlobalGreedy): roots, then the throughput phase only.
- `optimal`: Algorithm 1 on exact f (`optimal_selection`).

"Highest f" is the greedy order of TreeBatch.greedy_keys: log f descending (compared
at float32 precision), then depth, then request, then node index. Each phase takes
prefixes of that order, so the selected nodes always form connected trees.

Everything is vectorized over the batch: the SLO phase is a cumulative sum over each
tree's greedy prefix, sequential budget consumption across requests is a clip of a
cumulative sum, and the throughput phase is one partition of the remaining keys.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from adaserve.slo import slo_targets
from adaserve.tree import CandidateTree, TreeBatch, TreeError

POLICIES = ("adaserve", "paper", "equal", "global", "optimal")
ORDERS = ("descending_a", "ascending_a")
_TAKEN = np.uint64(np.iinfo(np.uint64).max)  # above every node's greedy key
_ELAPSED = operator.attrgetter("elapsed_ms")
_DECODED = operator.attrgetter("decoded")
_TPOT = operator.attrgetter("tpot_slo_ms")


class SelectionError(ValueError):
    """Bad selection input; the message names the field."""


@dataclass(frozen=True)
class RequestProgress:
    id: str
    tpot_slo_ms: float  # > 0
    elapsed_ms: float  # l_r: time since the request's first decoding step
    decoded: int  # o_r: tokens decoded so far


@dataclass(frozen=True)
class ProgressBatch(Sequence[RequestProgress]):
    """Many requests' progress as columns, which is how the wire carries it: select()
    takes it wherever it takes a list of RequestProgress, without building one object
    per request."""

    ids: Sequence[str]  # [n]
    tpot_slo_ms: np.ndarray  # float64 [n]
    elapsed_ms: np.ndarray  # float64 [n]
    decoded: np.ndarray  # int64 [n]

    def __post_init__(self) -> None:
        n = len(self.ids)
        for name in ("tpot_slo_ms", "elapsed_ms", "decoded"):
            if len(getattr(self, name)) != n:
                raise SelectionError(
                    f"requests.{name}: {len(getattr(self, name))} values for {n} ids"
                )

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, k: int) -> RequestProgress: ...

    @overload
    def __getitem__(self, k: slice) -> list[RequestProgress]: ...

    def __getitem__(self, k: int | slice) -> RequestProgress | list[RequestProgress]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        return RequestProgress(
            self.ids[k], float(self.tpot_slo_ms[k]), float(self.elapsed_ms[k]), int(self.decoded[k])
        )


@dataclass(frozen=True)
class SelectionParams:
    budget: int  # B, every root costs one slot
    depth: int  # d of the candidate trees (A_cap = min(A, d + 1))
    t_spec_ms: float  # predicted latency of this iteration
    policy: str = "adaserve"  # adaserve | paper | equal | global | optimal
    n_max: int | None = None  # None -> ceil(1.2 * B / n)
    order: str = "descending_a"  # descending_a (paper) | ascending_a (FlexFlow code)


@dataclass(frozen=True)
class Selection:
    selected: list[np.ndarray]  # per request: ascending node indices, always has 0
    a: np.ndarray  # float64 [n]
    a_cap: np.ndarray  # float64 [n]
    expected_accepted: np.ndarray  # float64 [n]: sum of f over selected (root = 1.0)
    budget_used: int
    invalid: bool = False  # only policy "optimal" sets it (selected is then empty)


def default_n_max(budget: int, n: int) -> int:
    """ceil(1.2 * B / n), as in the public AdaServe code; exact in integers."""
    return -(-6 * budget // (5 * n)) if n else budget


def select(
    requests: Sequence[RequestProgress],
    trees: Sequence[CandidateTree] | TreeBatch,
    params: SelectionParams,
) -> Selection:
    """Chooses the nodes to verify; raises SelectionError on bad input."""
    batch = trees if isinstance(trees, TreeBatch) else _batch_of(trees)
    _check_params(params)
    n = len(requests)
    if n != len(batch):
        raise SelectionError(f"requests: {n} requests but {len(batch)} candidate trees")
    if params.budget < n:
        raise SelectionError(
            f"budget: {params.budget} is smaller than the number of roots ({n}); "
            "every root costs one slot"
        )
    try:
        batch.validate()
    except TreeError as exc:
        raise SelectionError(str(exc)) from exc
    a, a_cap = slo_targets(*_progress_arrays(requests), params.t_spec_ms, params.depth)
    if n == 0:
        return Selection([], a, a_cap, np.zeros(0), 0)

    if params.policy == "optimal":
        return optimal_selection(batch, a, a_cap, params.budget)
    worth = None  # adaserve's throughput phase stops where nodes stop paying
    if params.policy in ("adaserve", "paper"):
        n_max = params.n_max if params.n_max is not None else default_n_max(params.budget, n)
        triage = params.policy == "adaserve"
        take, held = slo_phase(batch, a, a_cap, params.budget, n_max, params.order, triage)
        if triage:
            worth = (float(held.sum()), params.budget)
    elif params.policy == "equal":
        take = equal_shares(batch, params.budget)
    else:  # global
        take = np.ones(n, dtype=np.int64)
    mask = prefix_mask(batch, take)
    if params.policy != "equal":
        taken = int(take.sum())
        throughput_phase(batch, mask, params.budget - taken, taken, worth)
    return assemble(batch, mask, a, a_cap)


def slo_phase(
    batch: TreeBatch,
    a: np.ndarray,
    a_cap: np.ndarray,
    budget: int,
    n_max: int,
    order: str = "descending_a",
    triage: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """(nodes each request holds after the SLO phase, root included: int64 [n];
    expected accepted tokens of those nodes: float64 [n]).

    With `triage` (policy adaserve) only requests whose greedy prefix of at most n_max
    nodes reaches A_cap take part: one that cannot get back on track this iteration
    would spend its nodes on low-f tails that return little and delay the requests
    still savable; it keeps its root and competes in the throughput phase like
    everyone else. Without it (policy paper, Algorithm 2 as published) such a request
    takes its n_max best nodes."""
    want, acc = greedy_prefix(batch, a_cap, n_max)
    rows = np.arange(len(batch))
    if triage:  # savable ones only
        want = np.where(acc[rows, want - 1] >= a_cap, want, 1)
    rank = np.argsort(-a if order == "descending_a" else a, kind="stable")
    extra = want[rank] - 1  # the roots are paid for up front
    # Requests consume the budget one after another: each gets what it wants, clipped
    # to what the requests before it left over.
    before = np.cumsum(extra) - extra
    take = np.empty(len(batch), dtype=np.int64)
    take[rank] = np.minimum(extra, np.maximum(budget - len(batch) - before, 0)) + 1
    return take, acc[rows, take - 1]


def equal_shares(batch: TreeBatch, budget: int) -> np.ndarray:
    """EqualGreedy: B // n nodes each (the first B % n requests one more), at most the
    whole tree; shares a request cannot use are not passed on."""
    n = len(batch)
    share = budget // n + (np.arange(n) < budget % n)
    return np.minimum(share, batch.sizes)


def optimal_selection(batch: TreeBatch, a: np.ndarray, a_cap: np.ndarray, budget: int) -> Selection:
    """Algorithm 1 of paper 000: the selection maximizing total f subject to sum f >=
    A(r) for every request and at most `budget` nodes, or Selection(invalid=True) when
    none exists. The candidate trees given are taken to be the whole candidate space.

    Step 1 gives every request the shortest greedy prefix of its tree whose sum of f
    reaches A(r) (uncapped; the root counts 1.0 and costs one slot, as constraint (1)
    says). Step 2 spends the rest of B on the globally highest-f nodes left.

    INVALID exactly when no feasible allocation exists: some tree's total f is below its
    A(r), or the minimal prefixes together exceed B (a greedy prefix is the fewest nodes
    reaching a threshold, Lemma A.1). Otherwise the result maximizes total f: the best
    m-node subtree of a tree is its top-m prefix (parent-closed because a child's f never
    exceeds its parent's), prefix sums are concave in m, so topping up each request's
    minimal prefix with the globally best marginal nodes is optimal."""
    count, acc = greedy_prefix(batch, a)
    reached = acc[np.arange(len(batch)), count - 1] >= a
    taken = int(count.sum())
    if not reached.all() or taken > budget:
        return Selection([], a, a_cap, np.zeros(len(batch)), 0, invalid=True)
    mask = prefix_mask(batch, count)
    throughput_phase(batch, mask, budget - taken, taken)
    return assemble(batch, mask, a, a_cap)


def greedy_prefix(
    batch: TreeBatch, target: np.ndarray, n_max: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """For each tree, the shortest prefix of its greedy order (root included) whose sum
    of f reaches `target`, at most n_max nodes (None: the whole tree).

    Returns (count int64 [n], acc float64 [n, width]) where acc[k, j] is 1 + the sum of
    f over tree k's first j drafted nodes, added left to right as Algorithm 2 does."""
    width = batch.width if n_max is None else min(n_max, batch.width)
    acc = np.cumsum(np.exp(batch.cell_log_f()[batch.cells(batch.greedy_rows()[:, :width])]), axis=1)
    # acc never decreases (f >= 0), so the nodes needed are the root plus one per
    # prefix still short of the target; looking at `width` columns caps it at n_max.
    count = np.count_nonzero(acc[:, :-1] < target[:, None], axis=1) + 1
    if batch.inside() is not None:  # padding is no node: cap at each tree's size
        count = np.minimum(count, batch.sizes)
    return count, acc


def prefix_mask(batch: TreeBatch, take: np.ndarray) -> np.ndarray:
    """bool [n, width] grid: the first take[k] >= 1 nodes of each tree's greedy order."""
    last = batch.greedy_rows().reshape(-1)[batch.row_starts() + (take - 1)]
    return batch.greedy_keys() <= last[:, None]


def throughput_phase(
    batch: TreeBatch,
    mask: np.ndarray,
    spare: int,
    taken: int,
    worth: tuple[float, int] | None = None,
) -> None:
    """Adds (in place) the `spare` globally highest-f nodes not yet in `mask`, which
    holds `taken` nodes.

    With `worth` = (expected accepted tokens of `mask`, budget B) it stops early, at
    the first node that would lower the expected accepted tokens per unit of verify
    time. The cost model is the budget's own definition (B is the knee: a forward of
    B tokens costs about twice a single-token one), so a forward of N tokens costs
    about (B + N) token-units and a node of path probability f pays for itself while
    f > accepted / (B + N). At light load that keeps every useful node;
    near the budget it drops the long low-f tails whose verify time every request in
    the batch pays for."""
    k = min(spare, batch.num_nodes - taken)
    if k <= 0:
        return
    keys = batch.greedy_keys()
    left = np.where(mask, _TAKEN, keys).reshape(-1)
    if worth is None:
        # Keys are unique, so the k-th smallest is an exact cut.
        mask |= keys <= np.partition(left, k - 1)[k - 1]
        return
    best = np.partition(left, k - 1)[:k]
    best.sort()
    f = np.exp(batch.cell_log_f()[batch.cells(best)])
    accepted, budget = worth
    before = accepted + np.cumsum(f) - f  # expected accepted before each node
    # float: a budget near the int64 limit (any budget is legal input) must not overflow
    pays = f * (float(budget) + taken + np.arange(k)) > before
    # f falls and the bar rises along the order, so the nodes that pay are a prefix.
    stop = k if pays.all() else int(np.argmin(pays))
    if stop:
        mask |= keys <= best[stop - 1]


def assemble(batch: TreeBatch, mask: np.ndarray, a: np.ndarray, a_cap: np.ndarray) -> Selection:
    """The Selection of the nodes in `mask` (a [n, width] grid)."""
    cells = np.flatnonzero(mask)  # ascending: tree by tree, nodes ascending
    # Every root is selected, so each tree's first selected cell is its root's.
    starts = np.searchsorted(cells, batch.row_starts())
    nodes = cells % mask.shape[1]
    bounds = [*starts.tolist(), cells.shape[0]]
    return Selection(
        selected=[nodes[s:e] for s, e in itertools.pairwise(bounds)],
        a=a,
        a_cap=a_cap,
        expected_accepted=np.add.reduceat(np.exp(batch.cell_log_f()[cells]), starts),
        budget_used=int(cells.shape[0]),
    )


def _batch_of(trees: Sequence[CandidateTree]) -> TreeBatch:
    try:
        return TreeBatch.from_trees(trees)
    except TreeError as exc:
        raise SelectionError(str(exc)) from exc


def _check_params(p: SelectionParams) -> None:
    if not _is_int(p.budget) or p.budget <= 0:
        raise SelectionError(f"budget: must be a positive integer, got {p.budget!r}")
    if not _is_int(p.depth) or p.depth < 0:
        raise SelectionError(f"depth: must be a non-negative integer, got {p.depth!r}")
    if not _is_number(p.t_spec_ms) or not math.isfinite(p.t_spec_ms) or p.t_spec_ms < 0:
        raise SelectionError(f"t_spec_ms: must be a finite number >= 0, got {p.t_spec_ms!r}")
    if p.policy not in POLICIES:
        raise SelectionError(f"policy: {p.policy!r} is not one of {', '.join(POLICIES)}")
    if p.order not in ORDERS:
        raise SelectionError(f"order: {p.order!r} is not one of {', '.join(ORDERS)}")
    if p.n_max is not None and (not _is_int(p.n_max) or p.n_max < 1):
        raise SelectionError(f"n_max: must be a positive integer or None, got {p.n_max!r}")


def _progress_arrays(
    requests: Sequence[RequestProgress],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(requests, ProgressBatch):
        elapsed = np.asarray(requests.elapsed_ms, dtype=np.float64)
        decoded = np.asarray(requests.decoded, dtype=np.float64)
        tpot = np.asarray(requests.tpot_slo_ms, dtype=np.float64)
        cols = np.stack([elapsed, decoded, tpot])
    else:
        cols = _columns(requests)
        elapsed, decoded, tpot = cols
    # Whole-array checks first (NaN fails every comparison); locate only on failure.
    lo, hi = (cols.min(axis=1), cols.max(axis=1)) if len(requests) else (np.ones(3), np.ones(3))
    if not (lo[0] >= 0 and lo[1] >= 0 and lo[2] > 0 and np.all(hi < np.inf)):
        for name, values, ok in (
            ("tpot_slo_ms", tpot, np.isfinite(tpot) & (tpot > 0)),
            ("elapsed_ms", elapsed, np.isfinite(elapsed) & (elapsed >= 0)),
            ("decoded", decoded, np.isfinite(decoded) & (decoded >= 0)),
        ):
            if not ok.all():
                k = int(np.argmin(ok))
                need = "a positive finite number" if name == "tpot_slo_ms" else "finite and >= 0"
                raise SelectionError(
                    f"requests[{k}].{name}: must be {need}, got {float(values[k])!r} "
                    f"(request {requests[k].id!r})"
                )
    return elapsed, decoded, tpot


def _columns(requests: Sequence[RequestProgress]) -> np.ndarray:
    """float64 [3, n]: elapsed_ms, decoded, tpot_slo_ms, read in one C-level pass."""
    n = len(requests)
    fields = itertools.chain(map(_ELAPSED, requests), map(_DECODED, requests), map(_TPOT, requests))
    try:
        return np.fromiter(fields, np.float64, 3 * n).reshape(3, n)
    except (TypeError, ValueError, AttributeError) as exc:
        raise SelectionError(
            f"requests: each needs numeric tpot_slo_ms, elapsed_ms, decoded ({exc})"
        ) from exc


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)
