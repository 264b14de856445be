"""Candidate token trees as flat arrays.

A tree is a value: node 0 is the root (the request's last committed token, whose
target KV is not computed yet), and every other node's parent has a smaller index
(topological order). `logprobs[i]` is the drafter's conditional log-probability of
node i given its parent's path; the root's is 0.0, so its path probability is 1.0.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


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
        # Summed root-to-leaf, one depth level at a time: each node adds its own log q
        # to its parent's final sum, so a child's log f never exceeds its parent's (the
        # same arithmetic as TreeBatch, bit for bit).
        return _level_sums(self.logprobs, self.parents.astype(np.int64), self.depths(), [0])

    def path_probs(self) -> np.ndarray:
        """f(v) for every node (root is 1.0)."""
        return np.exp(self.path_logprobs())

    def depths(self) -> np.ndarray:
        depths = self._depths
        if depths is None:  # computed once; the tree is frozen, so bypass __setattr__
            depths = _depths(self.parents.astype(np.int64))
            object.__setattr__(self, "_depths", depths)
        return depths

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
        m = np.eye(len(self), dtype=bool)
        for idx in _levels(self.depths())[1:]:
            m[idx] |= m[self.parents[idx]]
        return m


def merge_trees(a: CandidateTree, b: CandidateTree) -> CandidateTree:
    """The union of two trees drafted for the same request (same root token).

    A node is its token path from the root: paths in both trees are one node, with
    f = max(f_a, f_b) (each drafter's estimate of the same acceptance; the larger is
    kept, never a sum, which could exceed 1). A child's f never exceeds its parent's,
    since max preserves f_a(child) <= f_a(parent) and f_b likewise, so its conditional
    log q = log f(child) - log f(parent) is <= 0. Nodes come in a's order, then b's new
    ones in b's order: every parent precedes its children (topological order)."""
    if int(a.tokens[0]) != int(b.tokens[0]):
        raise TreeError(
            f"merge_trees: roots differ ({int(a.tokens[0])} vs {int(b.tokens[0])}): "
            "trees of one request share its last committed token"
        )
    if len(b) == 1:
        return a
    if len(a) == 1:
        return b
    index: dict[tuple[int, int], int] = {}
    tokens, parents, logf = [int(a.tokens[0])], [-1], [0.0]
    for tree in (a, b):
        f = tree.path_logprobs()
        local = np.zeros(len(tree), dtype=np.int64)  # tree node -> merged node
        for v in range(1, len(tree)):
            key = (int(local[tree.parents[v]]), int(tree.tokens[v]))
            m = index.get(key)
            if m is None:
                m = index[key] = len(tokens)
                tokens.append(key[1])
                parents.append(key[0])
                logf.append(float(f[v]))
            else:
                logf[m] = max(logf[m], float(f[v]))
            local[v] = m
    lf = np.asarray(logf)
    par = np.asarray(parents)
    logq = np.zeros(lf.shape[0])
    logq[1:] = np.minimum(lf[1:] - lf[par[1:]], 0.0)
    return CandidateTree.build(tokens, parents, logq, validate=False)


_TOKENS = operator.attrgetter("tokens")
_PARENTS = operator.attrgetter("parents")
_LOGPROBS = operator.attrgetter("logprobs")
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_TIE_BITS = 32  # low bits of a greedy key: (depth, cell) packed, or their rank


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """Many candidate trees as flat concatenated arrays: tree k owns nodes
    [offsets[k], offsets[k + 1]).

    Per-node quantities are computed for the whole batch at once, on a grid view
    [num_trees, width] (tree k's node j at [k, j], padded past each tree's end), and
    cached; nothing loops over nodes in Python."""

    tokens: np.ndarray  # int32 [num_nodes]
    parents: np.ndarray  # int32 [num_nodes]; local to each tree, -1 for each root
    logprobs: np.ndarray  # float32 [num_nodes]; conditional log q, <= 0
    offsets: np.ndarray  # int64 [num_trees + 1]; offsets[0] == 0
    _cache: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def from_trees(trees: Sequence[CandidateTree]) -> TreeBatch:
        offsets = np.zeros(len(trees) + 1, dtype=np.int64)
        if not trees:
            return TreeBatch(
                np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), offsets
            )
        tokens = list(map(_TOKENS, trees))  # C-level attribute access: no per-tree bytecode
        sizes = np.fromiter(map(len, tokens), dtype=np.int64, count=len(trees))
        np.cumsum(sizes, out=offsets[1:])
        parents = np.concatenate(list(map(_PARENTS, trees)))
        logprobs = np.concatenate(list(map(_LOGPROBS, trees)))
        if parents.shape[0] != offsets[-1] or logprobs.shape[0] != offsets[-1]:
            for k, t in enumerate(trees):
                if t.parents.shape[0] != sizes[k] or t.logprobs.shape[0] != sizes[k]:
                    raise TreeError(
                        f"trees[{k}]: array lengths disagree (tokens={sizes[k]}, "
                        f"parents={t.parents.shape[0]}, logprobs={t.logprobs.shape[0]})"
                    )
        return TreeBatch(
            np.concatenate(tokens).astype(np.int32, copy=False),
            parents.astype(np.int32, copy=False),
            logprobs.astype(np.float32, copy=False),
            offsets,
        )

    @staticmethod
    def from_buffers(tokens: bytes, parents: bytes, logprobs: bytes, sizes: bytes) -> TreeBatch:
        """Wraps packed little-endian buffers (int32 tokens, int32 parents, float32
        log-probs, int32 nodes per tree) with np.frombuffer: no per-element work."""
        for name, buf in (
            ("tokens", tokens),
            ("parents", parents),
            ("logprobs", logprobs),
            ("sizes", sizes),
        ):
            if len(buf) % 4:
                raise TreeError(
                    f"trees.{name}: {len(buf)} bytes is not a whole number of 4-byte values"
                )
        sz = np.frombuffer(sizes, dtype=_I32)
        offsets = np.zeros(sz.shape[0] + 1, dtype=np.int64)
        np.cumsum(sz, out=offsets[1:])
        batch = TreeBatch(
            np.frombuffer(tokens, dtype=_I32),
            np.frombuffer(parents, dtype=_I32),
            np.frombuffer(logprobs, dtype=_F32),
            offsets,
        )
        batch._check_shape()
        return batch

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def num_nodes(self) -> int:
        return int(self.offsets[-1])

    @property
    def sizes(self) -> np.ndarray:
        """int64 [num_trees]"""
        return self._cached("sizes", lambda: np.diff(self.offsets))

    @property
    def width(self) -> int:
        """Nodes in the largest tree: the grid's second dimension."""
        return self._cached("width", lambda: int(self.sizes.max(initial=0)))

    def tree(self, k: int) -> CandidateTree:
        s = slice(int(self.offsets[k]), int(self.offsets[k + 1]))
        return CandidateTree(self.tokens[s], self.parents[s], self.logprobs[s])

    def trees(self) -> list[CandidateTree]:
        return [self.tree(k) for k in range(len(self))]

    def _cached(self, name: str, compute):
        if name not in self._cache:
            self._cache[name] = compute()
        return self._cache[name]

    # --- grid view -------------------------------------------------------------------

    def inside(self) -> np.ndarray | None:
        """bool [num_trees, width]: the real nodes; None when every tree fills its row."""

        def compute() -> np.ndarray | None:
            sizes = self.sizes
            if sizes.shape[0] == 0 or sizes.min() == self.width:
                return None
            return np.arange(self.width) < sizes[:, None]

        return self._cached("inside", compute)

    def to_grid(self, values: np.ndarray, fill) -> np.ndarray:
        """[num_nodes] -> [num_trees, width], `fill` past each tree's end."""
        inside = self.inside()
        if inside is None:
            return values.reshape(len(self), self.width)
        out = np.full(inside.shape, fill, dtype=values.dtype)
        out[inside] = values  # row-major order is the flat order
        return out

    def from_grid(self, grid: np.ndarray) -> np.ndarray:
        """[num_trees, width] -> [num_nodes]."""
        inside = self.inside()
        return grid.reshape(-1) if inside is None else grid[inside]

    def row_starts(self) -> np.ndarray:
        """int64 [num_trees]: flat grid index of each tree's root (k * width)."""
        return self._cached("row_starts", lambda: np.arange(len(self), dtype=np.int64) * self.width)

    def parent_grid(self) -> np.ndarray:
        """int32 [num_trees, width]: parents on the grid, 0 in the padding."""
        return self._cached("parent_grid", lambda: self.to_grid(self.parents, 0))

    # --- validation ------------------------------------------------------------------

    def _check_shape(self) -> None:
        sizes = self.sizes
        if sizes.shape[0] and sizes.min() < 1:
            k = int(np.argmax(sizes < 1))
            raise TreeError(
                f"trees[{k}].tokens: empty tree (size {int(sizes[k])}; the root is required)"
            )
        n = self.num_nodes
        if self.tokens.shape[0] != n or self.parents.shape[0] != n or self.logprobs.shape[0] != n:
            raise TreeError(
                f"trees: array lengths disagree (sum(sizes)={n}, tokens={self.tokens.shape[0]}, "
                f"parents={self.parents.shape[0]}, logprobs={self.logprobs.shape[0]})"
            )
        self._cache["shape_ok"] = True

    def validate(self) -> None:
        """Raises TreeError naming the field and the tree of the first problem. Cheap
        whole-batch reductions first; the offending node is located only on failure."""
        if self._cache.get("valid") or self.num_nodes == 0:
            return
        if not self._cache.get("shape_ok"):
            self._check_shape()
        par = self.parent_grid()
        if np.any(par[:, 0] != -1):
            k = int(np.argmax(par[:, 0] != -1))
            raise TreeError(
                f"trees[{k}].parents: node 0 is the root and must have parent -1, got {int(par[k, 0])}"
            )
        rest = par[:, 1:]
        # As uint32 a negative parent is huge: one comparison checks 0 <= parent < index.
        if np.any(rest.view(np.uint32) >= _node_indices(self.width)[1:]):
            bad = (rest < 0) | (rest >= np.arange(1, self.width))
            k, j = (int(x) for x in np.unravel_index(int(np.argmax(bad)), bad.shape))
            raise TreeError(
                f"trees[{k}].parents: parent of node {j + 1} is {int(rest[k, j])}, out of range "
                "or not topologically ordered (need 0 <= parent < index)"
            )
        lp = self.logprobs
        if not (lp.max() <= 0.0 and lp.min() > -np.inf):  # NaN fails both
            finite = np.isfinite(lp)
            if not finite.all():
                k, i = self._locate(int(np.argmin(finite)))
                raise TreeError(f"trees[{k}].logprobs: NaN or infinite log-probability at node {i}")
            g = int(np.argmax(lp > 0.0))
            k, i = self._locate(g)
            raise TreeError(
                f"trees[{k}].logprobs: positive log-probability {float(lp[g])} at node {i}"
            )
        if self.tokens.min() < 0:
            k, i = self._locate(int(np.argmin(self.tokens)))
            raise TreeError(f"trees[{k}].tokens: negative token id at node {i}")
        self._cache["valid"] = True

    def _locate(self, g: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.offsets, g, side="right")) - 1
        return k, g - int(self.offsets[k])

    # --- per-node quantities (the batch is validated first) --------------------------

    def depths(self) -> np.ndarray:
        """int32 [num_nodes]; roots are at depth 0."""
        return self.from_grid(self._sweep().imag).astype(np.int32)

    def path_logprobs(self) -> np.ndarray:
        """float64 [num_nodes]: log f(v), bit for bit what CandidateTree computes."""
        return np.ascontiguousarray(self.from_grid(self._sweep().real))

    def path_probs(self) -> np.ndarray:
        """float64 [num_nodes]: f(v); every root is 1.0."""
        return self.from_grid(self.path_probs_grid())

    def cell_log_f(self) -> np.ndarray:
        """float64 [num_trees * width] (a view): log f by flat grid index."""
        return self._sweep().real.reshape(-1)

    def path_probs_grid(self) -> np.ndarray:
        """float64 [num_trees, width]: f(v), 0.0 in the padding."""

        def compute() -> np.ndarray:
            f = np.exp(self._sweep().real)
            inside = self.inside()
            if inside is not None:
                f[~inside] = 0.0
            return f

        return self._cached("f", compute)

    def _sweep(self) -> npt.NDArray[np.complex128]:
        """complex128 [num_trees, width]: log f + 1j * depth for every grid cell.

        Each node adds its own (log q + 1j) to its parent's final value, so the sums run
        root to leaf exactly as a sequential walk adds them (complex addition is two
        independent float additions) and a child's log f never exceeds its parent's.
        One complex gather moves both quantities at the cost of one.

        Columns go in blocks whose nodes all have their parents in earlier columns;
        for beam trees (parents in the previous layer) a block is a layer, so a
        depth-d batch takes d vectorized steps."""

        def compute() -> npt.NDArray[np.complex128]:
            self.validate()
            n, width = len(self), self.width
            # Node-major [width, num_trees] while sweeping: a block is one contiguous slab.
            lp = self.to_grid(self.logprobs, 0.0).T
            state = np.add(lp, 1j, dtype=np.complex128, order="C")
            state[0] = 0.0  # the root is committed already: f = 1, depth 0
            if width > 1:
                par = self.parent_grid()[:, 1:]
                latest = par.max(axis=0).tolist()  # the latest parent in column j + 1
                cells = np.multiply(par.T, n, dtype=np.int64, order="C")
                cells += np.arange(n)  # flat index of each node's parent
                flat = state.reshape(-1)
                start = 1
                while start < width:
                    end = start + 1
                    while end < width and latest[end - 1] < start:
                        end += 1
                    state[start:end] += flat[cells[start - 1 : end - 1]]
                    start = end
            return np.ascontiguousarray(state.T)

        return self._cached("sweep", compute)

    # --- greedy order ----------------------------------------------------------------

    def greedy_keys(self) -> np.ndarray:
        """uint64 [num_trees, width]: a unique key per grid cell, smaller = taken first.

        The order is log f descending, then depth, then tree, then node index; padding
        sorts last. A child's log f never exceeds its parent's and ties go to the
        shallower node, so every prefix of this order, within a tree or across the
        batch, is a set of connected trees. log f is compared at float32 precision
        (the drafter's): values equal in float32 are ties."""
        return self._cached("keys", self._greedy_keys)

    def _greedy_keys(self) -> np.ndarray:
        state = self._sweep()
        n, width = state.shape
        cells = state.size
        # Two little-endian uint32 words per key: high = float32 bits of -log f, low =
        # the tie-breaker (depth, cell).
        words = np.empty((n, width, 2), dtype=np.uint32)
        with np.errstate(over="ignore"):
            # 0 - x makes -0.0 +0.0, so the bits of these non-negative floats sort as
            # the numbers do.
            np.subtract(0.0, state.real, out=words[..., 1].view(np.float32), dtype=np.float32)
        index_bits = max(1, (cells - 1).bit_length())
        if (width - 1).bit_length() + index_bits <= _TIE_BITS:  # depth < width
            tie = state.imag * float(1 << index_bits)
            np.add(tie, _cell_numbers(cells).reshape(n, width), out=words[..., 0], casting="unsafe")
            self._cache["index_mask"] = np.uint64((1 << index_bits) - 1)
        else:  # too many cells to pack depth and index: rank the pairs instead
            order = np.lexsort((np.arange(cells), state.imag.reshape(-1)))
            rank = np.empty(cells, dtype=np.uint32)
            rank[order] = np.arange(cells, dtype=np.uint32)
            words[..., 0] = rank.reshape(n, width)
            self._cache["rank_to_cell"] = order
        inside = self.inside()
        if inside is not None:
            words[..., 1][~inside] = 0xFFFFFFFF  # padding sorts after every real node
        return words.view(np.uint64).reshape(n, width)

    def greedy_rows(self) -> np.ndarray:
        """uint64 [num_trees, width]: each row of greedy_keys sorted, i.e. each tree's
        greedy order (column 0 is its root); `cells` maps keys back to grid cells."""
        return self._cached("rows", lambda: np.sort(self.greedy_keys(), axis=1))

    def cells(self, keys: np.ndarray) -> np.ndarray:
        """int64, same shape as keys: the flat grid cell (tree * width + node) of each."""
        self.greedy_keys()
        rank_to_cell = self._cache.get("rank_to_cell")
        if rank_to_cell is None:
            return (keys & self._cache["index_mask"]).astype(np.int64)
        return rank_to_cell[(keys & np.uint64(0xFFFFFFFF)).astype(np.int64)]


@functools.lru_cache(maxsize=16)
def _cell_numbers(cells: int) -> np.ndarray:
    """float64 [cells]: 0, 1, 2, ... (read-only, shared)."""
    out = np.arange(cells, dtype=np.float64)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=16)
def _node_indices(width: int) -> np.ndarray:
    """uint32 [width]: 0, 1, 2, ... (read-only, shared)."""
    out = np.arange(width, dtype=np.uint32)
    out.flags.writeable = False
    return out


def _depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every node of a forest given parent pointers (-1 for roots).

    Pointer doubling: after each round, d[i] is the distance from i to jump[i], and
    jump skips twice as far, so ceil(log2(depth)) + 1 vectorized rounds suffice."""
    jump = parents
    d = (jump >= 0).astype(np.int32)
    for _ in range(parents.shape[0].bit_length() + 2):
        live = jump >= 0
        if not live.any():
            return d
        safe = np.where(live, jump, 0)
        d = d + np.where(live, d[safe], 0)
        jump = np.where(live, jump[safe], -1)
    raise TreeError("parents: not a forest (a parent chain never reaches a root)")


def _levels(depths: np.ndarray) -> list[np.ndarray]:
    """Node indices grouped by depth, level 0 first."""
    small = depths.astype(np.int16) if depths.shape[0] and depths.max() < 2**15 else depths
    by_depth = np.argsort(small, kind="stable")  # radix sort for int16
    bounds = np.cumsum(np.bincount(depths))
    return np.split(by_depth, bounds[:-1])


def _level_sums(logprobs: np.ndarray, parents: np.ndarray, depths: np.ndarray, roots) -> np.ndarray:
    out = logprobs.astype(np.float64)
    out[roots] = 0.0  # the root is already committed: f(root) = 1
    for idx in _levels(depths)[1:]:
        out[idx] += out[parents[idx]]
    return out
