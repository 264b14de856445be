"""EagleDrafter: beam-tree drafting with an EAGLE head on the target's features.

A BeamDrafter (adaserve/speculate.py) with the same protocol, trees and rules: per
request only committed head KV plus `pending` (tokens the engine committed that are not
in the head's KV yet, here with their feature rows); one `speculate` forwards each
pending chain, expands the root into its top-w children and searches d layers of w
beams with the confidence stop; the chain is committed and every beam node dropped. It
fills in BeamDrafter's hooks for the head's second input.

What differs is the head's second input (adaserve/model/eagle.py): a committed token's
g is fuse(the target's features of the position before it), which the engine sends in
`DraftUpdate.hidden`; a drafted node's g is its parent's h, the head's own output.

`hidden` is checked before any state changes: a missing one, or one whose shape,
dtype or length does not match the update, is a ValueError (the drafter service
answers INVALID_ARGUMENT; the engine's FallbackDrafter decodes plainly this
iteration). A request whose state is lost (DrafterStateLost) cannot be re-sent from
its tokens alone: the engine has the verifier recompute its features (adaserve/engine/recovery.py
`recompute_features`).
"""

from __future__ import annotations

import numpy as np
import torch

from adaserve.drafter import DraftUpdate
from adaserve.model.eagle import EagleRunner
from adaserve.model.runner import SeqInput
from adaserve.speculate import BeamDrafter

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


class EagleDrafter(BeamDrafter):
    """BeamDrafter over an `EagleRunner`: the feature rows ride along with the pending
    tokens, and every forward gives each node its g."""

    kind = "eagle"

    def __init__(self, runner: EagleRunner) -> None:
        super().__init__(runner)
        self.spec = runner.spec
        self._rows: dict[str, np.ndarray] = {}  # feature rows of the pending tokens
        self._chain_rows: dict[str, np.ndarray] = {}  # this call's chains' rows
        self._root_h: torch.Tensor | None = None  # [n, H]: h of each active root
        self._g: torch.Tensor | None = None  # [n, w, H]: g of each frontier node
        self._front_h: torch.Tensor | None = None  # [m * w, H]: h of the last frontier

    def _check_inputs(self, updates: list[DraftUpdate], news: list[np.ndarray]) -> None:
        for u in updates:
            check_hidden(u, self.spec.feature_dim)

    def _take_rows(self, updates: list[DraftUpdate], cached: dict[str, int]) -> None:
        self._chain_rows = {}
        for u in updates:
            assert u.hidden is not None  # _check_inputs
            new = u.hidden[cached.get(u.id, 0) :]
            old = self._rows.get(u.id)
            self._chain_rows[u.id] = (
                new if old is None or not len(old) else np.concatenate([old, new])
            )

    def _committed_rows(self, ids: list[str]) -> None:
        self._rows.update(self._chain_rows)
        for sid in ids:
            self._rows[sid] = self._rows[sid][:0]
        self._chain_rows = {}

    def _drop(self, sid: str) -> None:
        super()._drop(sid)
        self._rows.pop(sid, None)

    def _forward_chains(
        self,
        updates: list[DraftUpdate],
        chains: dict[str, np.ndarray],
        logits_indices: list[int],
        prefill: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = [SeqInput.chain(u.id, chains[u.id], prefill) for u in updates]
        rows = np.concatenate([self._chain_rows[u.id] for u in updates])
        g = self.runner.fuse(torch.from_numpy(np.ascontiguousarray(rows)))
        return self.runner.forward_head(inputs, g, logits_indices)

    def _ingest(self, updates: list[DraftUpdate], chains: dict[str, np.ndarray]) -> None:
        self._forward_chains(updates, chains, [], prefill=True)

    def _first_step(self, active: list[DraftUpdate], chains: dict[str, np.ndarray]):
        last = (np.cumsum([chains[u.id].shape[0] for u in active]) - 1).tolist()
        logits, h = self._forward_chains(active, chains, last, prefill=False)
        self._root_h = h[torch.as_tensor(last, device=h.device)]
        self._g = None
        return logits

    def _frontier_step(self, inputs, alive: np.ndarray, width: int) -> torch.Tensor:
        if self._g is None:  # layer 1: every node hangs off its request's root
            assert self._root_h is not None
            n, hidden = self._root_h.shape
            self._g = self._root_h[:, None, :].expand(n, width, hidden).contiguous()
        rows = torch.as_tensor(alive, device=self._g.device)
        g = self._g[rows].reshape(-1, self._g.shape[-1])
        logits, self._front_h = self.runner.forward_head(inputs, g)
        return logits

    def _kept(self, alive: np.ndarray, beam: torch.Tensor) -> None:
        # Each kept child's g is the h of the frontier node it hangs off.
        assert self._g is not None and self._front_h is not None
        m, width = beam.shape
        hidden = self._g.shape[-1]
        front = self._front_h.view(m, width, hidden)
        idx = beam.to(front.device)[:, :, None].expand(m, width, hidden)
        self._g = self._g.clone()
        self._g[torch.as_tensor(alive, device=self._g.device)] = front.gather(1, idx).to(
            self._g.dtype
        )
