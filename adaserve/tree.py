"""Candidate token trees as flat arrays.

A tree is a value: node 0 is the root (the request's last committed token, whose
target KV is not computed yet), and every other node's parent has a smaller index
(topological order). `logprobs[i]` is the drafter's conditional log-probability of
node i given its parent's path; the root's is 0.0, so its path probability is 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class TreeError(ValueError):
    """A tree violates the array contract; the message names the field."""


@dataclass(frozen=True)
class CandidateTree:
    tokens: np.ndarray  # int32 [num_nodes]
    parents: np.ndarray  # int32 [num_nodes]; parents[0] == -1, parents[i] < i
    logprobs: np.ndarray  # float32 [num_nodes]; conditional log q, <= 0, root 0.0
    _depths: np.ndarray | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def build(tokens, parents, logprobs, *, validate: bool = True) -> CandidateTree:
        tree = CandidateTree(
            np.ascontiguousarray(tokens, dtype=np.int32),
            np.ascontiguousarray(parents, dtype=np.int32),
            np.ascontiguousarray(logprobs, dtype=np.float32),
        )
        if validate:
            tree.validate()
        return tree

    @staticmethod
    def root_only(token: int) -> CandidateTree:
        return CandidateTree.build([token], [-1], [0.0], validate=False)

    @staticmethod
    def chain(tokens, logprobs) -> CandidateTree:
        """A single path: tokens[0] is the root."""
        n = len(tokens)
        return CandidateTree.build(tokens, np.arange(-1, n - 1), logprobs)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def validate(self) -> None:
        n = self.tokens.shape[0]
        if n == 0:
            raise TreeError("tree.tokens: empty tree (the root is required)")
        if self.parents.shape[0] != n or self.logprobs.shape[0] != n:
            raise TreeError(
                f"tree: array lengths disagree (tokens={n}, parents={self.parents.shape[0]}, "
                f"logprobs={self.logprobs.shape[0]})"
            )
        if self.parents[0] != -1:
            raise TreeError("tree.parents: node 0 is the root and must have parent -1")
        if n > 1:
            p = self.parents[1:]
            idx = np.arange(1, n)
            if np.any(p < 0) or np.any(p >= idx):
                bad = int(idx[(p < 0) | (p >= idx)][0])
                raise TreeError(
                    f"tree.parents: parent of node {bad} is {int(self.parents[bad])}, "
                    "out of range or not topologically ordered (need 0 <= parent < index)"
                )
        if not np.all(np.isfinite(self.logprobs)):
            raise TreeError("tree.logprobs: NaN or infinite log-probability")
        if np.any(self.logprobs > 0.0):
            raise TreeError("tree.logprobs: positive log-probability")
        if np.any(self.tokens < 0):
            raise TreeError("tree.tokens: negative token id")

    def path_logprobs(self) -> np.ndarray:
        """log f(v) for every node: the sum of conditional log-probs from the root."""
        out = self.logprobs.astype(np.float64)
        # Parents precede children, so one pass per depth level suffices; vectorize by
        # level rather than by node.
        depths = self.depths()
        for level in range(1, int(depths.max(initial=0)) + 1):
            idx = np.nonzero(depths == level)[0]
            out[idx] += out[self.parents[idx]]
        out[0] = 0.0
        return out

    def path_probs(self) -> np.ndarray:
        """f(v) for every node (root is 1.0)."""
        return np.exp(self.path_logprobs())

    def depths(self) -> np.ndarray:
        if self._depths is not None:
            return self._depths
        # Pointer jumping: O(depth) vectorized steps instead of a per-node loop.
        d = np.zeros(len(self), dtype=np.int32)
        cur = self.parents.astype(np.int64)
        while True:
            live = cur >= 0
            if not live.any():
                break
            d += live
            cur = np.where(live, self.parents[np.maximum(cur, 0)], -1)
        object.__setattr__(self, "_depths", d)
        return d

    def subtree(self, nodes: np.ndarray) -> CandidateTree:
        """The tree restricted to `nodes` (ascending, includes 0, closed under parent)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        remap = np.full(len(self), -1, dtype=np.int32)
        remap[nodes] = np.arange(nodes.shape[0], dtype=np.int32)
        parents = self.parents[nodes]
        new_parents = np.where(parents >= 0, remap[np.maximum(parents, 0)], -1)
        if np.any(new_parents[1:] < 0):
            raise TreeError("subtree: node set is not closed under parent")
        return CandidateTree.build(
            self.tokens[nodes], new_parents, self.logprobs[nodes], validate=False
        )

    def ancestor_mask(self) -> np.ndarray:
        """bool [n, n]: mask[i, j] is True when j is i or an ancestor of i."""
        n = len(self)
        m = np.eye(n, dtype=bool)
        for i in range(1, n):
            m[i] |= m[self.parents[i]]
        return m
