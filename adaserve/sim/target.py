"""The modelled target: verification latency from the profile, acceptance from the model.

Implements the engine's `TargetModel` interface. `forward` advances the virtual clock by
the profile's latency for one forward over the batch's tree tokens (with their cached
context) and prefill chunk tokens (`HardwareProfile.forward_ms`, times the profile's
speed factor at the clock's time when it starts), then walks
every tree: at an accepted node the target picks child c with probability g(q_c) (the
calibration; siblings exclusive) or none of them, so a node is accepted with
probability prod g(q) along its path (= f(v) when g(q) = q). The bonus token is a
synthetic id. All trees are walked at once, one vectorized pass per depth level.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from adaserve.model.block_manager import BlockManager
from adaserve.sim.acceptance import Calibration
from adaserve.sim.clock import VirtualClock
from adaserve.sim.costmodel import HardwareProfile
from adaserve.target import ForwardResult, PrefillChunk, VerifyItem, VerifyResult


@dataclass
class TargetStats:
    """What the modelled verifier saw, for the summary and the tests."""

    iterations: int = 0
    request_steps: int = 0  # (request, iteration) pairs verified
    emitted: int = 0  # tokens emitted by verification (accepted drafts + bonus)
    drafted_verified: int = 0  # non-root nodes sent to verification
    accepted_drafts: int = 0
    # steps whose tree had drafted nodes, and what they emitted: the engine's
    # spec-decode counters skip root-only steps, so a live server reports this ratio
    drafted_steps: int = 0
    drafted_emitted: int = 0
    prefill_tokens: int = 0
    mixed_iterations: int = 0  # forwards carrying both trees and prefill chunks
    # per iteration with trees: (batch size, tree tokens verified, prefill tokens beside)
    batches: list[tuple[int, int, int]] = field(default_factory=list)
    # (simulated start time s, ms charged) of every forward: those carrying trees
    # (prefill chunks riding along included) and those carrying prompt chunks alone:
    # phase time per window of simulated time (driver.phase_windows)
    verify_log: list[tuple[float, float]] = field(default_factory=list)
    prefill_log: list[tuple[float, float]] = field(default_factory=list)

    @property
    def verify_ms(self) -> float:
        return sum(ms for _, ms in self.verify_log)

    @property
    def prefill_ms(self) -> float:
        return sum(ms for _, ms in self.prefill_log)


class SimTarget:
    # Token 0 is never drawn otherwise: it ends a request whose output length the
    # workload set while its max_tokens is the rest of the context (`stop_after`).
    eos_token_ids: tuple[int, ...] = (0,)

    def __init__(
        self,
        profile: HardwareProfile,
        clock: VirtualClock,
        calibration: Calibration,
        rng: np.random.Generator,
        block_size: int = 16,
        prefix_caching: bool = True,
    ) -> None:
        self.profile = profile
        self.clock = clock
        self.calibration = calibration
        self.rng = rng
        self.vocab_size = profile.vocab_size
        self.max_model_len = profile.max_model_len
        # The real block accounting (on-demand blocks, prefix cache, LRU eviction) over
        # the profile's KV capacity; only the tensors are left out.
        self.block_size = block_size
        self.num_blocks = max(1, profile.kv_capacity_tokens // block_size)
        self.blocks = BlockManager(self.num_blocks, block_size, prefix_caching)
        self.steps: dict[str, int] = {}  # verification steps per sequence (kept after free)
        # request id -> output tokens after which it emits eos (a chat without max_tokens
        # that ends on its own), and the tokens emitted so far
        self.stop_after: dict[str, int] = {}
        self._emitted: dict[str, int] = {}
        self.stats = TargetStats()

    # ---- TargetModel ------------------------------------------------------------------

    def add_sequence(self, seq_id: str, tokens: Sequence[int], use_cache: bool = True) -> int:
        return self.blocks.add(seq_id, tokens, use_cache)

    def forward(self, trees: Sequence[VerifyItem], chunks: Sequence[PrefillChunk]) -> ForwardResult:
        tree_tokens = sum(len(it.tree) for it in trees)
        prefill_tokens = sum(len(c.tokens) for c in chunks)
        growth: dict[str, int] = {it.seq_id: len(it.tree) for it in trees}
        for c in chunks:
            growth[c.seq_id] = growth.get(c.seq_id, 0) + len(c.tokens)
        # KVCacheFull here, as the real cache raises it, before anything changes.
        self.blocks.reserve({sid: self.blocks.committed(sid) + n for sid, n in growth.items()})
        context = sum(self.blocks.committed(it.seq_id) for it in trees)
        start = self.clock.now
        ms = self.profile.forward_ms(tree_tokens, prefill_tokens, context, start)
        self.clock.advance_ms(ms)
        verified = self._verify(trees) if trees else []
        first: list[int | None] = []
        for c in chunks:
            self.blocks.commit(c.seq_id, c.tokens.tolist())
            first.append(
                self._eos_or(c.seq_id, int(self.rng.integers(1, self.vocab_size)))
                if c.last
                else None
            )
        st = self.stats
        st.prefill_tokens += prefill_tokens
        if trees:
            st.verify_log.append((start, ms))
            st.batches.append((len(trees), tree_tokens, prefill_tokens))
        else:
            st.prefill_log.append((start, ms))
        if trees and chunks:
            st.mixed_iterations += 1
        return ForwardResult(verified, first)

    def _verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        trees = [it.tree for it in items]
        sizes = np.fromiter((len(t) for t in trees), dtype=np.int64, count=len(trees))
        tree_tokens = int(sizes.sum())
        accepted = self._walk(trees, sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        bonus = self.rng.integers(1, self.vocab_size, size=len(items), dtype=np.int32)
        results = []
        st = self.stats
        for k, it in enumerate(items):
            lo = offsets[k]
            # Accepted nodes form a chain and parents precede children: index order is
            # path order.
            path = accepted[(accepted >= lo) & (accepted < offsets[k + 1])] - lo
            emitted = np.append(it.tree.tokens[path[1:]], bonus[k]).astype(np.int32)
            cap = max(1, int(it.max_new))
            reason = "length" if len(emitted) >= cap else None
            emitted, path = emitted[:cap], path[:cap]
            stop = self.stop_after.get(it.seq_id)
            if stop is not None:
                done = self._emitted.get(it.seq_id, 0)
                if done + len(emitted) >= stop:  # its last token is eos
                    keep = max(stop - done, 1)
                    emitted, path = emitted[:keep].copy(), path[:keep]
                    emitted[-1], reason = 0, "stop"
                self._emitted[it.seq_id] = done + len(emitted)
            results.append(VerifyResult(path.astype(np.int32), emitted, reason))
            # The accepted path's nodes become committed KV (the bonus roots the next tree).
            self.blocks.commit(it.seq_id, it.tree.tokens[path].tolist())
            self.blocks.trim(it.seq_id, self.blocks.committed(it.seq_id))
            self.steps[it.seq_id] = self.steps.get(it.seq_id, 0) + 1
            st.emitted += len(emitted)
            st.accepted_drafts += len(path) - 1
            if len(it.tree) > 1:
                st.drafted_steps += 1
                st.drafted_emitted += len(emitted)
        st.iterations += 1
        st.request_steps += len(items)
        st.drafted_verified += tree_tokens - len(items)
        return results

    def free(self, seq_id: str) -> None:
        self.blocks.free(seq_id)  # _emitted stays: a preempted request comes back

    def _eos_or(self, seq_id: str, token: int) -> int:
        """The first token of a request: eos where its output is one token long."""
        if self.stop_after.get(seq_id) == 1:
            return 0
        self._emitted[seq_id] = 1
        return token

    def free_blocks(self) -> int:
        return self.blocks.num_free

    def blocks_needed(self, growth: dict[str, int]) -> int:
        return self.blocks.blocks_needed(
            {sid: self.blocks.committed(sid) + n for sid, n in growth.items()}
        )

    def kv_usage(self) -> float:
        return self.blocks.usage()

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.blocks.stats.queries, self.blocks.stats.hits

    def make_generator(self, seed: int | None) -> None:
        return None

    # ---- acceptance -------------------------------------------------------------------

    def _walk(self, trees, sizes: np.ndarray) -> np.ndarray:
        """Sorted global indices of every accepted node (roots included)."""
        offsets = np.repeat(np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        local_parents = np.concatenate([t.parents for t in trees]).astype(np.int64)
        gpar = np.where(local_parents >= 0, local_parents + offsets, -1)
        nonroot = np.nonzero(gpar >= 0)[0]
        accepted = gpar < 0
        if nonroot.size == 0:
            return np.nonzero(accepted)[0]
        q = np.exp(np.concatenate([t.logprobs for t in trees]).astype(np.float64)[nonroot])
        g = self.calibration(q, self.rng)
        # Siblings share their parent's unit interval: child c owns [lo_c, lo_c + g_c);
        # a parent with sum g > 1 is renormalized (the target picks one token).
        par = gpar[nonroot]
        order = np.argsort(par, kind="stable")
        par_sorted, g_sorted = par[order], g[order]
        sums = np.bincount(par_sorted, weights=g_sorted, minlength=len(gpar))
        g_sorted = g_sorted / np.maximum(sums[par_sorted], 1.0)
        csum = np.cumsum(g_sorted)
        first = np.concatenate([[True], par_sorted[1:] != par_sorted[:-1]])
        group_start = np.maximum.accumulate(np.where(first, np.arange(len(csum)), 0))
        before = csum - g_sorted - (csum[group_start] - g_sorted[group_start])
        lo = np.empty_like(before)
        lo[order] = before
        g_node = np.empty_like(g_sorted)
        g_node[order] = g_sorted
        u = self.rng.random(len(gpar))  # one draw per parent: the target's choice there
        chosen = np.zeros(len(gpar), dtype=bool)
        chosen[nonroot] = (u[par] >= lo) & (u[par] < lo + g_node)
        depth = _depths(gpar)
        for level in range(1, int(depth.max()) + 1):
            idx = np.nonzero(depth == level)[0]
            accepted[idx] = chosen[idx] & accepted[gpar[idx]]
        return np.nonzero(accepted)[0]


def _depths(gpar: np.ndarray) -> np.ndarray:
    """Depth of every node of a forest (pointer doubling; -1 marks roots)."""
    jump = gpar
    d = (jump >= 0).astype(np.int64)
    while True:
        live = jump >= 0
        if not live.any():
            return d
        safe = np.where(live, jump, 0)
        d = d + np.where(live, d[safe], 0)
        jump = np.where(live, jump[safe], -1)
