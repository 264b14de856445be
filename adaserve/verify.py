"""Tree verification: which drafted tokens the target accepts, plus the bonus token.

Functions of (selected tree, target logits of its nodes, the request's sampling
params); no engine state, inputs never mutated. The only state touched is the
request's random stream, advanced by exactly the number of tokens emitted.

Every node v gets the target's choice c(v): the argmax of p(. | path(v)) when greedy,
otherwise the inverse-CDF draw from the filtered p(. | path(v)) with the uniform of
v's output position (stream position + depth(v), see sampling.py). A node is
accepted iff its token equals its parent's choice and its parent is accepted; the root
always is. The walk ends at the deepest accepted node a (ties: lowest index) and emits
the tokens of the accepted nodes below the root, then the bonus c(a).

Lossless: along the accepted path each emitted token is c(path), i.e. the target's
argmax, or a draw from p(. | path) with a fresh uniform, exactly what plain decoding
does at that position. With a `TokenRng`, a seeded request gets the same tokens with
or without speculation.

Stop handling follows vLLM: a stop token (eos unless ignore_eos, or any of
stop_token_ids) ends the output and is included in the token ids (the engine leaves it
out of the text); `max_new` caps the count. A stop token on the last allowed position
reports "stop".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from adaserve import sampling
from adaserve.request import SamplingParams
from adaserve.sampling import TokenRng
from adaserve.target import VerifyResult
from adaserve.tree import CandidateTree

# TokenRng: reproducible and speculation-independent. torch.Generator: one fresh key is
# drawn from it per call (lossless, reproducible only for identical call sequences).
# None: fresh entropy.
Rng = TokenRng | torch.Generator | None


def _stream(rng: Rng) -> TokenRng:
    if isinstance(rng, TokenRng):
        return rng
    if isinstance(rng, torch.Generator):
        key = int(torch.randint(0, 2**62, (1,), generator=rng, device=rng.device))
        return TokenRng(key)
    return TokenRng(None)


def _walk_path(tree: CandidateTree, choice: np.ndarray) -> np.ndarray:
    """Reference walk: follow every child equal to its parent's choice; return the path
    (root first) to the deepest such node, lowest index on ties."""
    children: list[list[int]] = [[] for _ in range(len(tree))]
    for v in range(1, len(tree)):
        children[int(tree.parents[v])].append(v)
    best, frontier = 0, [0]
    while frontier:
        frontier = [c for v in frontier for c in children[v] if tree.tokens[c] == choice[v]]
        if frontier:
            best = min(frontier)
    path = [best]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return np.asarray(path[::-1], dtype=np.int64)


def _finish(
    path: np.ndarray,
    tokens: np.ndarray,
    choice: np.ndarray,
    sp: SamplingParams,
    eos_token_ids: Sequence[int],
    max_new: int | None,
) -> VerifyResult:
    """Emit along `path` (root first) and truncate at stop tokens / the length cap."""
    emitted = np.append(tokens[path[1:]], choice[path[-1]]).astype(np.int32)
    reason = None
    stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
    if stops:
        hit = np.isin(emitted, np.asarray(stops, dtype=np.int64))
        if hit.any():
            emitted, reason = emitted[: int(hit.argmax()) + 1], "stop"
    if max_new is not None:
        if emitted.shape[0] > max_new:
            emitted, reason = emitted[:max_new], "length"
        elif emitted.shape[0] == max_new and reason is None:
            reason = "length"
    return VerifyResult(path[: emitted.shape[0]].astype(np.int32), emitted, reason)


def _check(tree: CandidateTree, rows: int, max_new: int | None) -> None:
    if rows != len(tree):
        raise ValueError(f"verify: {rows} logit rows for a tree of {len(tree)} nodes")
    if max_new is not None and max_new < 1:
        raise ValueError(f"verify: max_new must be >= 1 (tokens left to emit), got {max_new}")


def verify_tree(
    tree: CandidateTree,
    logits: torch.Tensor,
    sp: SamplingParams,
    rng: Rng = None,
    *,
    eos_token_ids: Sequence[int] = (),
    max_new: int | None = None,
) -> VerifyResult:
    """Reference verification of one tree. logits: float32 [num_nodes, vocab], node order;
    max_new: tokens the request may still emit (None: no cap)."""
    if logits.dim() != 2:
        raise ValueError(f"verify: logits must be [num_nodes, vocab], got {tuple(logits.shape)}")
    _check(tree, logits.shape[0], max_new)
    if sp.greedy:
        choice = logits.argmax(dim=-1).cpu().numpy()
        stream = None
    else:
        stream = _stream(rng)
        temp, top_k, top_p = sampling.row_params([sp], [len(tree)], logits.device)
        min_p = sampling.row_min_p([sp], [len(tree)], logits.device)
        probs = sampling.filtered_probs(logits, temp, top_k, top_p, min_p)
        choice = sampling.sample_from_probs(probs, stream.at(tree.depths())).cpu().numpy()
    res = _finish(_walk_path(tree, choice), tree.tokens, choice, sp, eos_token_ids, max_new)
    if stream is not None:
        stream.advance(res.emitted_tokens.shape[0])
    return res


def verify_batch(
    trees: Sequence[CandidateTree],
    logits: torch.Tensor,
    sps: Sequence[SamplingParams],
    rngs: Sequence[Rng] | None = None,
    *,
    eos_token_ids: Sequence[int] = (),
    max_new: Sequence[int | None] | None = None,
) -> list[VerifyResult]:
    """Verify many trees from one forward: logits [sum num_nodes, vocab], trees in order.

    One argmax over the whole batch; sampled rows filtered and drawn in one batched call;
    a vectorized accept pass over all nodes; a short per-tree path walk. Gives exactly
    what verify_tree gives tree by tree.
    """
    n = len(trees)
    rngs = [None] * n if rngs is None else list(rngs)
    caps = [None] * n if max_new is None else list(max_new)
    if not (len(sps) == len(rngs) == len(caps) == n):
        raise ValueError(
            f"verify_batch: {n} trees, {len(sps)} sampling params, {len(rngs)} rngs, "
            f"{len(caps)} max_new"
        )
    sizes = np.array([len(t) for t in trees], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    if logits.dim() != 2 or logits.shape[0] != offsets[-1]:
        raise ValueError(f"verify_batch: logits {tuple(logits.shape)} for {int(offsets[-1])} nodes")
    for t, cap in zip(trees, caps, strict=True):
        _check(t, len(t), cap)
    if n == 0:
        return []

    choice_t = logits.argmax(dim=-1)
    sampled = [i for i in range(n) if not sps[i].greedy]
    streams = {i: _stream(rngs[i]) for i in sampled}
    if sampled:
        rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in sampled])
        rows_t = torch.as_tensor(rows, device=logits.device)
        sampled_sps = [sps[i] for i in sampled]
        temp, top_k, top_p = sampling.row_params(sampled_sps, sizes[sampled], logits.device)
        min_p = sampling.row_min_p(sampled_sps, sizes[sampled], logits.device)
        probs = sampling.filtered_probs(logits.index_select(0, rows_t), temp, top_k, top_p, min_p)
        u = np.concatenate([streams[i].at(trees[i].depths()) for i in sampled])
        choice_t = choice_t.index_copy(0, rows_t, sampling.sample_from_probs(probs, u))
    choice = choice_t.cpu().numpy()

    tokens = np.concatenate([t.tokens for t in trees])
    gpar = np.concatenate(
        [np.where(t.parents >= 0, t.parents + o, -1) for t, o in zip(trees, offsets, strict=False)]
    )
    depth = np.concatenate([t.depths() for t in trees])
    nonroot = gpar >= 0
    match = np.zeros(tokens.shape[0], dtype=bool)
    match[nonroot] = tokens[nonroot] == choice[gpar[nonroot]]
    accepted = ~nonroot
    # A parent sits one level up, so one pass per level settles every node.
    for level in range(1, int(depth.max()) + 1):
        idx = np.nonzero(depth == level)[0]
        accepted[idx] = match[idx] & accepted[gpar[idx]]
    score = np.where(accepted, depth, -1)

    results = []
    for i, t in enumerate(trees):
        lo, hi = offsets[i], offsets[i + 1]
        v = int(score[lo:hi].argmax())  # first maximum: the lowest index on ties
        path = [v]
        while v != 0:
            v = int(t.parents[v])
            path.append(v)
        path_arr = np.asarray(path[::-1], dtype=np.int64)
        res = _finish(path_arr, t.tokens, choice[lo:hi], sps[i], eos_token_ids, caps[i])
        if i in streams:
            streams[i].advance(res.emitted_tokens.shape[0])
        results.append(res)
    return results
