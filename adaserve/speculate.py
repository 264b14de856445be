"""Drafter side: batched beam-search speculation (AdaServe paper section 4.3, step 1).

Per request the drafter keeps only committed draft KV plus `pending`: tokens the
engine committed that are not in the draft KV yet (their last one is the root). One
`speculate` call:

* step 1 forwards every request's pending chain in one batch and expands each root
  into its top-w children by log q;
* step j = 2..d forwards the n*w frontier tokens in one batch (scratch nodes hanging
  off their beam parents) and keeps, per request, the top-w of the w*|V| children by
  path log-probability: log_softmax, add the parent's path log-prob, top-k over
  [n, w*V];
* afterwards the pending chain is committed and every beam node is dropped, so
  speculative KV only ever lives in the runner's scratch for the call.

An update marked `ingest` (a prompt chunk the target prefills in the same iteration)
is forwarded into the draft KV and committed whole, with no logits; its tree is
root-only. A long prompt so reaches the drafter chunk by chunk, never in one forward.

With `stop_prob` > 0 a request's search ends before a step in which none of its beams
has a path probability of at least `stop_prob`: the drafter's own confidence decides
how deep each tree goes, up to `depth` (EAGLE-2 and SpecDec++ stop on the same signal).
Those requests drop out of the later forwards, and the call ends when none is left.

Each request gets a beam tree: root (the last committed token) then d layers of w
nodes, 1 + d*w nodes, layer j's nodes at 1 + (j-1)*w ... j*w, conditional log q per
node, parents topologically ordered.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import torch

from adaserve import metrics
from adaserve.drafter import DrafterStateLost, DrafterStats, DraftUpdate
from adaserve.model.block_manager import KVCacheFull
from adaserve.tree import CandidateTree

# Conditional log-probs are floored here so trees stay finite when the drafter gives a
# token zero probability (f = exp(-1e4) is 0 for selection anyway).
_LOGQ_FLOOR = -1.0e4


class BeamDrafter:
    """Drafter over a `ModelRunner` (the draft model).

    `draft_to_target` (int64 [V_draft]) maps the rows of a reduced draft LM head to
    target token ids; by default it is taken from `runner.draft_to_target` when the
    runner has one, else the head is the target vocabulary itself.
    """

    trusted = True  # its trees are well-formed by construction (adaserve/drafter.py)

    def __init__(self, runner, draft_to_target: torch.Tensor | np.ndarray | None = None) -> None:
        self.runner = runner
        if draft_to_target is None:
            draft_to_target = getattr(runner, "draft_to_target", None)
        # torch.as_tensor, not np.asarray: the loader's map already lives on the runner's
        # device, and a CUDA tensor has no numpy view.
        self._d2t = (
            None
            if draft_to_target is None
            else torch.as_tensor(draft_to_target, dtype=torch.int64).to(runner.device)
        )
        self._pending: dict[str, np.ndarray] = {}  # int32: known, not yet in the draft KV
        self._last_rows = last_rows_kwarg(runner)

    # -- protocol --------------------------------------------------------------------

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        try:
            trees = self._speculate(updates, depth, width, stop_prob)
        except KVCacheFull:
            # The draft KV follows the target's rule: blocks on demand, and under
            # pressure the requests not in this call give theirs up (they re-sync from
            # their history when next asked: DrafterStateLost).
            idle = set(self._pending) - {u.id for u in updates}
            if not idle:
                raise
            self.release(sorted(idle))
            trees = self._speculate(updates, depth, width, stop_prob)
        metrics.drafter_kv_usage.set(float(self.runner.kv_usage()))
        return trees

    def _speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float
    ) -> list[CandidateTree]:
        if depth < 0 or width < 1:
            raise ValueError(f"speculate: need depth >= 0 and width >= 1, got {depth}, {width}")
        if not (0.0 <= stop_prob < 1.0):  # NaN fails too
            raise ValueError(f"speculate: stop_prob must be in [0, 1), got {stop_prob}")
        ids = [u.id for u in updates]
        if len(set(ids)) != len(ids):
            raise ValueError("speculate: a request appears twice in one call")
        news = [np.asarray(u.new_tokens, dtype=np.int32).reshape(-1) for u in updates]
        self._check_inputs(updates, news)
        self._check_consistent(updates, news)

        # Full histories (first call, or a resync after DrafterStateLost) start afresh.
        fresh = {u.id for u, new in zip(updates, news, strict=True) if new.shape[0] == u.total_len}
        cached: dict[str, int] = {}
        for u, new in zip(updates, news, strict=True):
            if u.id in fresh:
                self._drop(u.id)
                # The draft KV's prefix cache may hold the history's start already.
                cached[u.id] = self.runner.add_sequence(u.id, new)
                self._pending[u.id] = np.zeros(0, dtype=np.int32)
        chains = {
            u.id: np.concatenate([self._pending[u.id], new[cached.get(u.id, 0) :]])
            for u, new in zip(updates, news, strict=True)
        }
        self._take_rows(updates, cached)
        roots = [int(chains[u.id][-1]) for u in updates]
        limit = int(getattr(self.runner, "max_model_len", 1 << 62))
        ingest = [u for u in updates if u.ingest and chains[u.id].shape[0]]
        # Requests whose draft steps would run past the drafter's context stay root-only.
        active = [u for u in updates if not u.ingest and depth > 0 and u.total_len + depth <= limit]
        layers = None
        try:
            if ingest:
                self._ingest(ingest, chains)
            if active:
                layers = self._beam_search(active, chains, depth, width, stop_prob)
        except BaseException:
            for u in [*ingest, *active]:
                if u.id not in fresh:
                    self.runner.commit(u.id, [])  # drop this call's scratch only
            for sid in fresh:  # never half-built: the engine re-sends these in full
                self._drop(sid)
            raise
        for u in [*ingest, *active]:
            self.runner.commit(u.id, range(chains[u.id].shape[0]))
            chains[u.id] = np.zeros(0, dtype=np.int32)
        self._pending.update(chains)
        self._committed_rows([u.id for u in [*ingest, *active]])

        row = {u.id: i for i, u in enumerate(active)}
        trees = []
        for u, root in zip(updates, roots, strict=True):
            if layers is not None and u.id in row:
                i, k = row[u.id], int(layers[3][row[u.id]])
                trees.append(
                    _beam_tree(root, layers[0][i, :k], layers[1][i, :k], layers[2][i, :k], width)
                )
            else:
                trees.append(CandidateTree.root_only(root))
        return trees

    def release(self, ids: list[str]) -> None:
        for sid in ids:
            self._drop(sid)

    def stats(self) -> DrafterStats:
        return DrafterStats(len(self._pending), float(self.runner.kv_usage()))

    # -- what a drafter with more inputs per token than its token (EagleDrafter) adds --

    def _check_inputs(self, updates: list[DraftUpdate], news: list[np.ndarray]) -> None:
        """Checks an update's other inputs before any state changes (ValueError)."""

    def _take_rows(self, updates: list[DraftUpdate], cached: dict[str, int]) -> None:
        """The updates' other inputs join the pending chains (`cached`: leading tokens
        of a fresh history its prefix cache holds)."""

    def _committed_rows(self, ids: list[str]) -> None:
        """The chains of `ids` went into the draft KV."""

    def _first_step(self, active: list[DraftUpdate], chains: dict[str, np.ndarray]):
        """Step 1: each active request's pending chain; logits of its last node."""
        from adaserve.model.runner import SeqInput

        inputs = [SeqInput.chain(u.id, chains[u.id]) for u in active]
        return forward_last(self.runner, self._last_rows, inputs)

    def _frontier_step(self, inputs, alive: np.ndarray, width: int) -> torch.Tensor:
        """Steps 2..d: the frontier nodes of the requests still searching (`alive`,
        w each); logits of every node."""
        return self.runner.forward(inputs)

    def _kept(self, alive: np.ndarray, beam: torch.Tensor) -> None:
        """The search kept, per alive request, the children of frontier nodes `beam`
        ([m, w], index within the request's frontier)."""

    # -- internals -------------------------------------------------------------------

    def _check_consistent(self, updates: list[DraftUpdate], news: list[np.ndarray]) -> None:
        lost = []
        for u, new in zip(updates, news, strict=True):
            if u.total_len < 1 or new.shape[0] > u.total_len:
                raise ValueError(
                    f"speculate({u.id!r}): total_len {u.total_len} with {new.shape[0]} new tokens"
                )
            if new.shape[0] == u.total_len:
                continue  # a full history is always consistent
            pending = self._pending.get(u.id)
            if pending is None:
                lost.append(u.id)
                continue
            have = self.runner.committed_len(u.id) + pending.shape[0]
            # With nothing pending and nothing new, the root's draft distribution (its KV
            # is committed already) cannot be recomputed: resync instead.
            if have + new.shape[0] != u.total_len or pending.shape[0] + new.shape[0] == 0:
                lost.append(u.id)
        if lost:
            for sid in lost:
                self._drop(sid)  # stale: the resync rebuilds it
            raise DrafterStateLost(lost)

    def _drop(self, sid: str) -> None:
        self._pending.pop(sid, None)
        self.runner.free(sid)

    def _ingest(self, updates: list[DraftUpdate], chains: dict[str, np.ndarray]) -> None:
        """Forward the chains of prompt chunks into the draft KV: no logits are needed
        (where the runner can skip them)."""
        from adaserve.model.runner import SeqInput

        ingest(
            self.runner,
            self._last_rows,
            [SeqInput.chain(u.id, chains[u.id], prefill=True) for u in updates],
        )

    @torch.inference_mode()
    def _beam_search(
        self,
        active: list[DraftUpdate],
        chains: dict[str, np.ndarray],
        depth: int,
        width: int,
        stop_prob: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
        """Per active request: target token ids, beam-parent index and conditional log q
        of every layer, as [n, depth, width] CPU tensors (beam parent: index of the
        parent within the previous layer; layer 0's is 0 = the root), and how many of
        those layers it searched (int64 [n]; the rest of its rows are filler)."""
        from adaserve.model.runner import SeqInput

        n = len(active)
        logits = self._first_step(active, chains)
        if width > logits.shape[-1]:
            raise ValueError(
                f"speculate: width {width} exceeds the draft vocabulary ({logits.shape[-1]})"
            )
        cond, draft_ids = _top_children(logits, width)  # [n, w] each
        path = cond
        beam_parent = torch.zeros(n, width, dtype=torch.int64, device=cond.device)
        out_ids, out_par, out_cond = [draft_ids], [beam_parent], [cond]
        base = np.array([chains[u.id].shape[0] for u in active], dtype=np.int64)  # root + 1
        searched = np.ones(n, dtype=np.int64)
        alive = np.arange(n)  # requests still searching
        for j in range(1, depth):
            if stop_prob > 0:
                # A request goes on while one of its beams is likely enough to be
                # accepted; the others keep the layers they have.
                likely = (path.max(dim=-1).values >= math.log(stop_prob)).cpu().numpy()
                alive = alive[likely[alive]]
                if alive.shape[0] == 0:
                    break
            searched[alive] = j + 1
            frontier = self._to_target(draft_ids).cpu().numpy().astype(np.int32)  # [n, w]
            par = out_par[-1].cpu().numpy()
            # Scratch index of each frontier node's parent: the root for layer 1, else
            # the parent's slot in the previous layer (layers follow the chain in order).
            if j == 1:
                parents = np.broadcast_to((base - 1)[:, None], (n, width))
            else:
                parents = base[:, None] + (j - 2) * width + par
            inputs = [
                SeqInput(active[i].id, frontier[i], parents[i].astype(np.int32)) for i in alive
            ]
            # The best w of a request's w*|V| children are among each beam's own best w
            # (a beam adds one constant path log-prob to all its children), so rank the
            # w*w survivors instead of [n, w*V] scores.
            m = alive.shape[0]
            child_cond, child_ids = _top_children(self._frontier_step(inputs, alive, width), width)
            rows = torch.as_tensor(alive, device=path.device)
            scores = path[rows][:, :, None] + child_cond.view(m, width, width)
            best, flat = scores.view(m, width * width).topk(width, dim=-1)  # [m, w]
            new_ids = child_ids.view(m, width * width).gather(1, flat)
            new_cond = child_cond.view(m, width * width).gather(1, flat)
            self._kept(alive, flat // width)
            if m == n:
                path, beam_parent, draft_ids, cond = best, flat // width, new_ids, new_cond
            else:  # requests that stopped carry copies of their last layer, never read
                path, beam_parent = path.clone(), beam_parent.clone()
                draft_ids, cond = draft_ids.clone(), cond.clone()
                path[rows], beam_parent[rows] = best, flat // width
                draft_ids[rows], cond[rows] = new_ids, new_cond
            out_ids.append(draft_ids)
            out_par.append(beam_parent)
            out_cond.append(cond)
        ids = self._to_target(torch.stack(out_ids, dim=1)).cpu()
        par = torch.stack(out_par, dim=1).cpu()
        return ids, par, torch.stack(out_cond, dim=1).cpu(), searched

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self._d2t is None else self._d2t[draft_ids]


def _top_children(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log q and draft ids of each row's `width` most likely children, [m, w] each:
    top-k on the raw logits minus their logsumexp (no [m, V] log_softmax is written)."""
    logits = logits.float()
    vals, ids = logits.topk(width, dim=-1)
    return vals - torch.logsumexp(logits, dim=-1, keepdim=True), ids


def _beam_tree(root: int, ids: torch.Tensor, par: torch.Tensor, cond: torch.Tensor, width: int):
    """The CandidateTree of one request from its [depth, width] layer tensors."""
    depth = ids.shape[0]
    layer_start = 1 + np.arange(depth, dtype=np.int64)[:, None] * width  # first node of layer
    parents = np.where(
        np.arange(depth)[:, None] == 0, 0, layer_start - width + par.numpy()
    )  # layer 0 hangs off the root
    tokens = np.concatenate([[root], ids.numpy().reshape(-1)])
    logprobs = np.concatenate([[0.0], cond.numpy().reshape(-1).clip(_LOGQ_FLOOR, 0.0)])
    return CandidateTree.build(
        tokens, np.concatenate([[-1], parents.reshape(-1)]), logprobs, validate=False
    )


def ingest(runner, rows: str | None, inputs) -> None:
    """The drafter's forward over chunks it only reads into its KV (prompt chunks): no
    logits where the runner can skip them, else the last rows' (`forward_last`).
    `rows`: the runner's `last_rows_kwarg`. `adaserve profile` times the same call."""
    if rows == "logits_indices":
        runner.forward(inputs, logits_indices=[])
    else:
        forward_last(runner, rows, inputs)


def forward_last(runner, rows: str | None, inputs) -> torch.Tensor:
    """Logits of each input's last node only: a draft step's first forward needs nothing
    else, and the LM head dominates a small drafter's cost. `rows`: the runner's
    `last_rows_kwarg`."""
    if rows == "last_only":
        return runner.forward(inputs, last_only=True)
    last = np.cumsum([len(x.tokens) for x in inputs]) - 1
    if rows == "logits_indices":
        return runner.forward(inputs, logits_indices=last.tolist())
    return runner.forward(inputs)[torch.as_tensor(last, device=runner.device)]


def last_rows_kwarg(runner) -> str | None:
    """How this runner restricts logits to chosen rows: `last_only=True`, the
    contract's `logits_indices`, or not at all (then rows are picked afterwards)."""
    try:
        params = inspect.signature(runner.forward).parameters
    except (TypeError, ValueError):
        return None
    for name in ("logits_indices", "last_only"):
        if name in params:
            return name
    return None
