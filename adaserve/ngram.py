"""The n-gram drafter: trees from the request's own tokens, no model, no process.

Prompt lookup (Saxena 2023; vLLM's `ngram` proposer) and SuffixDecoding (Oliaro et al.
2024) draft from matches of the request's most recent tokens earlier in its prompt and
output: a summary, a code edit or a RAG answer copies spans of its input, and a small
model's output repeats itself. This drafter runs inside the verifier and implements
the `Drafter` protocol, so `FallbackDrafter`, selection and verification take its
trees like any other.

Per request it keeps the committed tokens and a suffix index: every `min_n`-gram ->
the positions where it ends, appended as tokens arrive. One lookup is then O(1) in the
context length (prompt lookup scans the whole context each step): the occurrences of
the last `min_n` tokens, each extended backwards with numpy to its full match length
(at most `max_n`). The occurrences sharing the longest match, of length k, are the
evidence; their continuations (the `max_matches` most recent) form a trie, and each trie
node's conditional probability is the fraction of the continuations through its parent
that agree on it, smoothed by pseudo-continuations that agree with nothing:

    q(c | u) = count(u c) / (count(u) + prior_count / m ** length_power),  m = k + depth(u)

m is the match length the node extends (each level drafted assumes one more matched
token). On the embedded target's own summaries and chats (train prompts, not the
held-out ones) a single match's next token was accepted 31% of the time at k = 1, 53%
at 2, 62% at 3, 81% at 4 and 93% from 6 on: the defaults (2.2, 1.6) give 0.31, 0.58,
0.72, 0.81 and 0.89. So a token that continued every one of many long matches is near
1, one seen once after a single token 0.31, and one that continued half of the matches
about half that: the path probabilities f selection weighs are the measured agreement
of the request's own history. The tree keeps, per level, the `width` nodes
of highest f (a beam over the trie), `depth` levels at most; `stop_prob` ends it
before a level where no node reaches that f, as `BeamDrafter` does. A continuation
that runs into the end of the context continues with its own predicted tokens (period
of the repeat), so a loop is drafted as deep as asked.

No match, no tree: the request gets a root-only tree (plain decoding this iteration).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaserve.drafter import DrafterStateLost, DraftUpdate
from adaserve.tree import CandidateTree


@dataclass(frozen=True)
class NgramParams:
    min_n: int = 1  # the shortest match that drafts (and the index's key length)
    max_n: int = 16  # matches are compared backwards this far at most
    max_matches: int = 32  # most recent occurrences of the longest match a tree uses
    prior_count: float = 2.2  # pseudo-continuations agreeing with no candidate, at m = 1
    length_power: float = 1.6  # ... divided by m ** length_power (m: the match length)
    scan: int = 256  # most recent occurrences of the key extended per lookup

    def __post_init__(self) -> None:
        if not (1 <= self.min_n <= self.max_n):
            raise ValueError(f"ngram: need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.max_matches < 1 or self.scan < self.max_matches:
            raise ValueError("ngram: need max_matches >= 1 and scan >= max_matches")
        if not self.prior_count > 0:  # a single match must not be certain
            raise ValueError(f"ngram: prior_count must be > 0, got {self.prior_count}")
        if not self.length_power >= 0:
            raise ValueError(f"ngram: length_power must be >= 0, got {self.length_power}")


class SuffixIndex:
    """One request's committed tokens and where each `n`-gram of them ends."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._tokens = np.zeros(64, dtype=np.int32)
        self.length = 0
        self._ends: dict[tuple[int, ...], list[int]] = {}

    @property
    def tokens(self) -> np.ndarray:
        """int32 [length] (a view)."""
        return self._tokens[: self.length]

    def extend(self, new: np.ndarray) -> None:
        need = self.length + new.shape[0]
        if need > self._tokens.shape[0]:
            grown = np.zeros(max(need, 2 * self._tokens.shape[0]), dtype=np.int32)
            grown[: self.length] = self.tokens
            self._tokens = grown
        start = self.length
        self._tokens[start:need] = new
        self.length = need
        toks = self._tokens[:need].tolist()
        n = self.n
        for end in range(max(start, n - 1), need):
            self._ends.setdefault(tuple(toks[end - n + 1 : end + 1]), []).append(end)

    def matches(self, scan: int, max_n: int) -> tuple[np.ndarray, int]:
        """(continuation starts, match length): where the longest earlier occurrence(s)
        of the context's suffix end, +1, most recent last; length 0 when none."""
        n, length = self.n, self.length
        if length <= n:
            return np.zeros(0, dtype=np.int64), 0
        toks = self.tokens
        ends = self._ends.get(tuple(toks[length - n :].tolist()), [])
        # The last entry is the suffix itself (it ends at length - 1).
        cand = np.asarray(ends[-scan - 1 : -1], dtype=np.int64)
        if cand.shape[0] == 0:
            return cand, 0
        # Extend each occurrence backwards while it still agrees with the suffix.
        matched = np.full(cand.shape[0], n, dtype=np.int64)
        alive = np.ones(cand.shape[0], dtype=bool)
        for k in range(n, min(max_n, length)):
            ok = alive & (cand - k >= 0)
            ok[ok] = toks[cand[ok] - k] == toks[length - 1 - k]
            alive = ok
            if not alive.any():
                break
            matched[alive] += 1
        best = int(matched.max())
        return cand[matched == best] + 1, best


def continuation_tree(
    tokens: np.ndarray,
    starts: np.ndarray,
    depth: int,
    width: int,
    prior_count: float,
    stop_prob: float = 0.0,
    match_len: int = 1,
    length_power: float = 0.0,
) -> CandidateTree:
    """The beam-pruned trie of the continuations at `starts`, whose contexts matched
    the last `match_len` tokens (see the module doc); root = tokens[-1]. A continuation
    past the end repeats its own period."""
    root = int(tokens[-1])
    length = tokens.shape[0]
    if depth < 1 or starts.shape[0] == 0:
        return CandidateTree.root_only(root)
    # conts[i, j]: the j-th token after occurrence i (periodic past the end).
    # The j-th predicted token past the end is the (j - period)-th predicted one, so
    # offset j reads tokens[start + j % period]: the same for j < period.
    period = (length - starts)[:, None]
    conts = tokens[starts[:, None] + np.arange(depth)[None, :] % period]
    # Level by level: each kept node's children are the distinct next tokens of the
    # continuations through it; keep the `width` children of highest f.
    node_tokens, node_parents, node_logq = [root], [-1], [0.0]
    frontier = [(0, np.arange(starts.shape[0]), 0.0)]  # (node, continuations, log f)
    log_stop = np.log(stop_prob) if stop_prob > 0 else -np.inf
    for j in range(depth):
        children = []
        prior = prior_count / float(match_len + j) ** length_power
        for node, rows, logf in frontier:
            vals, inv, counts = np.unique(conts[rows, j], return_inverse=True, return_counts=True)
            logq = np.log(counts) - np.log(rows.shape[0] + prior)
            for c in range(vals.shape[0]):
                children.append((logf + logq[c], node, int(vals[c]), logq[c], rows[inv == c]))
        children.sort(key=lambda ch: -ch[0])
        children = children[:width]
        if not children or children[0][0] < log_stop:
            break
        frontier = []
        for logf, node, tok, logq, rows in children:
            node_tokens.append(tok)
            node_parents.append(node)
            node_logq.append(float(logq))
            frontier.append((len(node_tokens) - 1, rows, logf))
    return CandidateTree.build(node_tokens, node_parents, node_logq, validate=False)


class NgramDrafter:
    """`Drafter` over each request's own tokens (module doc). Thread-compatible like
    the other drafters: the engine calls it from its loop thread only."""

    trusted = True  # its trees are well-formed by construction (adaserve/drafter.py)

    def __init__(self, params: NgramParams | None = None) -> None:
        self.params = params or NgramParams()
        self._index: dict[str, SuffixIndex] = {}

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        if depth < 0 or width < 1:
            raise ValueError(f"speculate: need depth >= 0 and width >= 1, got {depth}, {width}")
        if not (0.0 <= stop_prob < 1.0):
            raise ValueError(f"speculate: stop_prob must be in [0, 1), got {stop_prob}")
        ids = [u.id for u in updates]
        if len(set(ids)) != len(ids):
            raise ValueError("speculate: a request appears twice in one call")
        news = [np.asarray(u.new_tokens, dtype=np.int32).reshape(-1) for u in updates]
        lost = []
        for u, new in zip(updates, news, strict=True):
            if u.total_len < 1 or new.shape[0] > u.total_len:
                raise ValueError(
                    f"speculate({u.id!r}): total_len {u.total_len} with {new.shape[0]} new tokens"
                )
            idx = self._index.get(u.id)
            full = new.shape[0] == u.total_len
            if not full and (idx is None or idx.length + new.shape[0] != u.total_len):
                lost.append(u.id)
        if lost:  # raised before any state changes, as the protocol asks
            for sid in lost:
                self._index.pop(sid, None)
            raise DrafterStateLost(lost)
        p = self.params
        trees = []
        for u, new in zip(updates, news, strict=True):
            if new.shape[0] == u.total_len:
                self._index[u.id] = SuffixIndex(p.min_n)
            idx = self._index[u.id]
            idx.extend(new)
            if u.ingest or depth == 0:
                trees.append(CandidateTree.root_only(int(idx.tokens[-1])))
                continue
            starts, k = idx.matches(p.scan, p.max_n)
            trees.append(
                continuation_tree(
                    idx.tokens,
                    starts[-p.max_matches :],
                    depth,
                    width,
                    p.prior_count,
                    stop_prob,
                    k,
                    p.length_power,
                )
            )
        return trees

    def release(self, ids: list[str]) -> None:
        for sid in ids:
            self._index.pop(sid, None)

    @property
    def num_sequences(self) -> int:
        return len(self._index)
