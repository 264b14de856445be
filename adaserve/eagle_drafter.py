"""EagleDrafter: beam-tree drafting with an EAGLE head on the target's features.

The same protocol, trees and rules as BeamDrafter (adaserve/speculate.py): per request
only committed head KV plus `pending` (tokens the engine committed that are not in the
head's KV yet, now with their feature rows); one `speculate` forwards each pending
chain, expands the root into its top-w children and searches d layers of w beams with
the confidence stop; the chain is committed and every beam node dropped.

What differs is the head's second input (adaserve/model/eagle.py): a committed token's
g is fuse(the target's features of the position before it), which the engine sends in
`DraftUpdate.hidden`; a drafted node's g is its parent's h, the head's own output.

`hidden` is checked before any state changes: a missing one, or one whose shape,
dtype or length does not match the update, is a ValueError (the drafter service
answers INVALID_ARGUMENT; the engine's FallbackDrafter decodes plainly this
iteration). A request whose state is lost (DrafterStateLost) cannot be re-sent from
its tokens alone: the engine has the verifier recompute its features (engine.py
`_recompute_features`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from adaserve import metrics
from adaserve.model.block_manager import KVCacheFull
from adaserve.model.eagle import EagleRunner
from adaserve.model.runner import SeqInput
from adaserve.speculate import (
    DrafterStateLost,
    DrafterStats,
    DraftUpdate,
    _beam_tree,
    _top_children,
)
from adaserve.tree import CandidateTree

HIDDEN_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


def check_hidden(u: DraftUpdate, dim: int) -> np.ndarray:
    """The update's feature rows, or ValueError saying what is wrong with them."""
    h = u.hidden
    k = int(np.asarray(u.new_tokens).reshape(-1).shape[0])
    if h is None:
        raise ValueError(f"speculate({u.id!r}): an EAGLE drafter needs hidden for its tokens")
    if h.dtype not in HIDDEN_DTYPES:
        raise ValueError(f"speculate({u.id!r}): hidden dtype {h.dtype} (float16 or float32)")
    if h.shape != (k, dim):
        raise ValueError(f"speculate({u.id!r}): hidden shape {h.shape}, expected {(k, dim)}")
    if not np.isfinite(h).all():
        raise ValueError(f"speculate({u.id!r}): hidden holds non-finite values")
    return h


class EagleDrafter:
    """Drafter over an `EagleRunner`."""

    kind = "eagle"

    def __init__(self, runner: EagleRunner) -> None:
        self.runner = runner
        self.spec = runner.spec
        d2t = runner.draft_to_target
        self._d2t = None if d2t is None else torch.as_tensor(d2t, dtype=torch.int64)
        self._pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # tokens, features

    # -- protocol --------------------------------------------------------------------

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        try:
            trees = self._speculate(updates, depth, width, stop_prob)
        except KVCacheFull:  # as BeamDrafter: idle requests give their KV up first
            idle = set(self._pending) - {u.id for u in updates}
            if not idle:
                raise
            self.release(sorted(idle))
            trees = self._speculate(updates, depth, width, stop_prob)
        metrics.drafter_kv_usage.set(float(self.runner.kv_usage()))
        return trees

    def release(self, ids: list[str]) -> None:
        for sid in ids:
            self._drop(sid)

    def stats(self) -> DrafterStats:
        return DrafterStats(len(self._pending), float(self.runner.kv_usage()))

    # -- internals -------------------------------------------------------------------

    def _speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float
    ) -> list[CandidateTree]:
        if depth < 0 or width < 1:
            raise ValueError(f"speculate: need depth >= 0 and width >= 1, got {depth}, {width}")
        if not (0.0 <= stop_prob < 1.0):
            raise ValueError(f"speculate: stop_prob must be in [0, 1), got {stop_prob}")
        ids = [u.id for u in updates]
        if len(set(ids)) != len(ids):
            raise ValueError("speculate: a request appears twice in one call")
        news = [np.asarray(u.new_tokens, dtype=np.int32).reshape(-1) for u in updates]
        feats = [check_hidden(u, self.spec.feature_dim) for u in updates]
        self._check_consistent(updates, news)

        fresh = {u.id for u, new in zip(updates, news, strict=True) if new.shape[0] == u.total_len}
        chains: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for u, new, f in zip(updates, news, feats, strict=True):
            skip = 0
            if u.id in fresh:
                self._drop(u.id)
                # The head's KV at a position is a function of the tokens up to it (their
                # features are), so its prefix cache is as valid as a model drafter's.
                skip = self.runner.add_sequence(u.id, new.tolist())
                self._pending[u.id] = (np.zeros(0, np.int32), f[:0])
            tok, old = self._pending[u.id]
            chains[u.id] = (np.concatenate([tok, new[skip:]]), np.concatenate([old, f[skip:]]))
        roots = [int(chains[u.id][0][-1]) for u in updates]
        limit = int(self.runner.max_model_len)
        ingest = [u for u in updates if u.ingest and chains[u.id][0].shape[0]]
        active = [u for u in updates if not u.ingest and depth > 0 and u.total_len + depth <= limit]
        layers = None
        try:
            if ingest:
                self._forward_chains(ingest, chains, [])
            if active:
                layers = self._beam_search(active, chains, depth, width, stop_prob)
        except BaseException:
            for u in [*ingest, *active]:
                if u.id not in fresh:
                    self.runner.commit(u.id, [])
            for sid in fresh:
                self._drop(sid)
            raise
        for u in [*ingest, *active]:
            self.runner.commit(u.id, range(chains[u.id][0].shape[0]))
            tok, f = chains[u.id]
            chains[u.id] = (tok[:0], f[:0])
        self._pending.update(chains)

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

    def _check_consistent(self, updates: list[DraftUpdate], news: list[np.ndarray]) -> None:
        lost = []
        for u, new in zip(updates, news, strict=True):
            if u.total_len < 1 or new.shape[0] > u.total_len:
                raise ValueError(
                    f"speculate({u.id!r}): total_len {u.total_len} with {new.shape[0]} new tokens"
                )
            if new.shape[0] == u.total_len:
                continue
            pending = self._pending.get(u.id)
            if pending is None:
                lost.append(u.id)
                continue
            have = self.runner.committed_len(u.id) + pending[0].shape[0]
            if have + new.shape[0] != u.total_len or pending[0].shape[0] + new.shape[0] == 0:
                lost.append(u.id)
        if lost:
            for sid in lost:
                self._drop(sid)
            raise DrafterStateLost(lost)

    def _drop(self, sid: str) -> None:
        self._pending.pop(sid, None)
        self.runner.free(sid)

    def _forward_chains(
        self,
        updates: list[DraftUpdate],
        chains: dict[str, tuple[np.ndarray, np.ndarray]],
        logits_indices: list[int],
        prefill: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = [SeqInput.chain(u.id, chains[u.id][0], prefill) for u in updates]
        feats = np.concatenate([chains[u.id][1] for u in updates])
        g = self.runner.fuse(torch.from_numpy(np.ascontiguousarray(feats)))
        return self.runner.forward_head(inputs, g, logits_indices)

    @torch.inference_mode()
    def _beam_search(
        self,
        active: list[DraftUpdate],
        chains: dict[str, tuple[np.ndarray, np.ndarray]],
        depth: int,
        width: int,
        stop_prob: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
        """As BeamDrafter._beam_search, every frontier node reading its parent's h."""
        n = len(active)
        lens = np.array([chains[u.id][0].shape[0] for u in active], dtype=np.int64)
        last = (np.cumsum(lens) - 1).tolist()
        logits, h_all = self._forward_chains(active, chains, last, prefill=False)
        hidden = h_all.shape[-1]
        h_root = h_all[torch.as_tensor(last, device=h_all.device)]  # [n, H]
        if width > logits.shape[-1]:
            raise ValueError(
                f"speculate: width {width} exceeds the draft vocabulary ({logits.shape[-1]})"
            )
        cond, draft_ids = _top_children(logits, width)
        path = cond
        beam_parent = torch.zeros(n, width, dtype=torch.int64, device=cond.device)
        parent_h = h_root[:, None, :].expand(n, width, hidden).contiguous()  # g of frontier
        out_ids, out_par, out_cond = [draft_ids], [beam_parent], [cond]
        base = lens
        searched = np.ones(n, dtype=np.int64)
        alive = np.arange(n)
        for j in range(1, depth):
            if stop_prob > 0:
                likely = (path.max(dim=-1).values >= math.log(stop_prob)).cpu().numpy()
                alive = alive[likely[alive]]
                if alive.shape[0] == 0:
                    break
            searched[alive] = j + 1
            frontier = self._to_target(draft_ids).cpu().numpy().astype(np.int32)
            par = out_par[-1].cpu().numpy()
            if j == 1:
                parents = np.broadcast_to((base - 1)[:, None], (n, width))
            else:
                parents = base[:, None] + (j - 2) * width + par
            inputs = [
                SeqInput(active[i].id, frontier[i], parents[i].astype(np.int32)) for i in alive
            ]
            m = alive.shape[0]
            rows = torch.as_tensor(alive, device=path.device)
            g = parent_h[rows].reshape(m * width, hidden)
            child_logits, h_front = self.runner.forward_head(inputs, g)
            child_cond, child_ids = _top_children(child_logits, width)
            scores = path[rows][:, :, None] + child_cond.view(m, width, width)
            best, flat = scores.view(m, width * width).topk(width, dim=-1)
            new_ids = child_ids.view(m, width * width).gather(1, flat)
            new_cond = child_cond.view(m, width * width).gather(1, flat)
            beam = flat // width  # which frontier node each child hangs off
            new_parent_h = h_front.view(m, width, hidden).gather(
                1, beam[:, :, None].expand(m, width, hidden).to(h_front.device)
            )
            path, beam_parent = path.clone(), beam_parent.clone()
            draft_ids, cond = draft_ids.clone(), cond.clone()
            path[rows], beam_parent[rows] = best, beam
            draft_ids[rows], cond[rows] = new_ids, new_cond
            parent_h = parent_h.clone()
            parent_h[rows] = new_parent_h.to(parent_h.dtype)
            out_ids.append(draft_ids)
            out_par.append(beam_parent)
            out_cond.append(cond)
        ids = self._to_target(torch.stack(out_ids, dim=1)).cpu()
        par = torch.stack(out_par, dim=1).cpu()
        return ids, par, torch.stack(out_cond, dim=1).cpu(), searched

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self._d2t is None else self._d2t.to(draft_ids.device)[draft_ids]
