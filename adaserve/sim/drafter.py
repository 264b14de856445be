"""The modelled drafter: beam-shaped candidate trees with synthetic probabilities.

Implements the engine's `Drafter` interface. Each call runs a real beam search, over
synthetic top-k distributions from the acceptance model instead of a small model's
logits, and advances the virtual clock by the profile's draft-step latency (times the
profile's speed factor at the clock's time when the call starts): the first
forward takes every newly committed token (the root included, a whole prompt for a new
request), each further layer one token per beam (n * w). Prompt chunks sent for
ingestion (`DraftUpdate.ingest`) are charged in the first forward (past the draft-step
table, along the profile's `draft_prefill` curve where it has one) and get no tree.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from adaserve.drafter import DrafterStateLost, DraftUpdate
from adaserve.sim.acceptance import DraftSampler
from adaserve.sim.clock import VirtualClock
from adaserve.sim.costmodel import HardwareProfile
from adaserve.tree import CandidateTree


class SimDrafter:
    def __init__(
        self,
        profile: HardwareProfile,
        clock: VirtualClock,
        sampler_for: Callable[[str], DraftSampler],
        rng: np.random.Generator,
        expansion: tuple[int, ...] | None = None,
    ) -> None:
        self.profile = profile
        self.clock = clock
        self.sampler_for = sampler_for  # request id -> its class's draft distribution
        self.rng = rng
        self.expansion = expansion  # static tree shape (SpecInfer); None -> beam trees
        self._len: dict[str, int] = {}  # committed tokens this drafter holds per request
        self._last: dict[str, int] = {}
        self.draft_log: list[tuple[float, float]] = []  # (simulated start s, ms) per call
        self.tokens_read = 0  # committed tokens sent to it (prompt chunks included)

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        lost = [
            u.id
            for u in updates
            if self._len.get(u.id, 0) + len(u.new_tokens) != u.total_len or u.total_len == 0
        ]
        if lost:
            raise DrafterStateLost(lost)
        new_tokens = 0
        for u in updates:
            self._len[u.id] = u.total_len
            if len(u.new_tokens):
                self._last[u.id] = int(u.new_tokens[-1])
            new_tokens += len(u.new_tokens)
        self.tokens_read += new_tokens
        drafting = [u for u in updates if not u.ingest] if depth >= 1 else []
        start = self.clock.now
        # Forward 1 reads the new tokens (prompt chunks being ingested included);
        # forward l >= 2 reads layer l - 1 of the requests still searching
        # (BeamDrafter's stop_prob rule).
        ms = self.profile.draft_forward_ms(new_tokens, start)
        trees: dict[str, CandidateTree] = {}
        if drafting:
            if self.expansion is not None:
                layers = self._static_layers(drafting, depth, self.expansion)
            else:
                layers = self._beam_layers(drafting, depth, max(1, width))
            searched = _searched_layers(layers, stop_prob)
            ms += sum(
                self.profile.draft_ms(int((searched > k).sum()) * q.shape[1], start)
                for k, (_, q) in enumerate(layers[:-1], start=1)
                if (searched > k).any()
            )
            # Layers are stored in order, so a shallower tree is a prefix of the full one.
            sizes = np.cumsum([1, *(q.shape[1] for _, q in layers)])
            for u, t, m in zip(
                drafting, self._trees(drafting, layers), sizes[searched], strict=True
            ):
                trees[u.id] = (
                    CandidateTree(t.tokens[:m], t.parents[:m], t.logprobs[:m]) if m < len(t) else t
                )
        if ms > 0:
            self.clock.advance_ms(ms)
            self.draft_log.append((start, ms))
        return [trees.get(u.id) or CandidateTree.root_only(self._last[u.id]) for u in updates]

    @property
    def draft_ms_total(self) -> float:
        return sum(ms for _, ms in self.draft_log)

    def release(self, ids: list[str]) -> None:
        for i in ids:
            self._len.pop(i, None)
            self._last.pop(i, None)

    # ---- tree shapes ------------------------------------------------------------------

    def _children(self, updates: list[DraftUpdate], per_row: int, k: int) -> np.ndarray:
        """float64 [n, per_row, k]: top-k conditional probabilities at per_row nodes of
        each request, drawn from that request's class distribution."""
        n = len(updates)
        out = np.empty((n, per_row, k))
        groups: dict[int, tuple[DraftSampler, list[int]]] = {}
        for i, u in enumerate(updates):
            s = self.sampler_for(u.id)
            groups.setdefault(id(s), (s, []))[1].append(i)
        for sampler, rows in groups.values():
            out[rows] = sampler(len(rows) * per_row, k, self.rng).reshape(len(rows), per_row, k)
        return out

    def _beam_layers(self, updates, depth: int, w: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer (parent index within the previous layer [n, w], q [n, w]).

        Layer 1 is the root's top-w; each later layer keeps the w best of the w * w
        expansions of the previous beams by path probability, as beam search does."""
        n = len(updates)
        # One draw for every node that gets expanded: the root, then w beams per layer.
        q_all = self._children(updates, 1 + (depth - 1) * w, w)
        q1 = q_all[:, 0, :]
        layers = [(np.zeros((n, w), dtype=np.int64), q1)]
        path = np.log(q1)
        for layer in range(1, depth):
            q = q_all[:, 1 + (layer - 1) * w : 1 + layer * w, :].reshape(n, w * w)
            cand = path.repeat(w, axis=1) + np.log(q)
            top = np.argsort(-cand, axis=1, kind="stable")[:, :w]
            layers.append((top // w, np.take_along_axis(q, top, axis=1)))
            path = np.take_along_axis(cand, top, axis=1)
        return layers

    def _static_layers(
        self, updates, depth: int, expansion: tuple[int, ...]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every node of layer l - 1 gets its top expansion[l - 1] tokens as children."""
        n = len(updates)
        expansion = expansion[:depth]
        widths = np.cumprod((1, *expansion[:-1]))  # nodes expanded at each layer
        # Each node's top-e of its top-k_max is its top-e: one draw serves every layer.
        q_all = self._children(updates, int(widths.sum()), max(expansion))
        layers, start = [], 0
        for e, width in zip(expansion, widths, strict=True):
            q = q_all[:, start : start + width, :e].reshape(n, width * e)
            parents = np.repeat(np.arange(width), e)[None, :].repeat(n, axis=0)
            layers.append((parents, q))
            start += width
        return layers

    def _trees(self, updates, layers) -> list[CandidateTree]:
        n = len(updates)
        sizes = [q.shape[1] for _, q in layers]
        total = 1 + sum(sizes)
        parents = np.empty((n, total), dtype=np.int32)
        logq = np.zeros((n, total), dtype=np.float32)
        parents[:, 0] = -1
        start, prev_start = 1, 0
        for (par, q), size in zip(layers, sizes, strict=True):
            parents[:, start : start + size] = prev_start + par
            logq[:, start : start + size] = np.log(q)
            prev_start, start = start, start + size
        tokens = self.rng.integers(1, self.profile.vocab_size, size=(n, total), dtype=np.int32)
        for i, u in enumerate(updates):
            tokens[i, 0] = self._last[u.id]
        # Rows of C-contiguous arrays are contiguous with the right dtypes already: wrap
        # them directly (valid by construction; the tests validate).
        return [CandidateTree(tokens[i], parents[i], logq[i]) for i in range(n)]


def _searched_layers(layers: list[tuple[np.ndarray, np.ndarray]], stop_prob: float) -> np.ndarray:
    """int64 [n]: how many layers each request searches when its search ends before a
    step in which no node of its last layer has path probability >= stop_prob."""
    n = layers[0][1].shape[0]
    searched = np.full(n, len(layers), dtype=np.int64)
    if stop_prob <= 0:
        return searched
    searched[:] = 1
    alive = np.ones(n, dtype=bool)
    path = np.log(layers[0][1])
    for k, (par, q) in enumerate(layers[1:], start=1):
        alive &= path.max(axis=1) >= np.log(stop_prob)
        searched[alive] = k + 1
        path = np.take_along_axis(path, par, axis=1) + np.log(q)
    return searched
