"""Held-out acceptance of an EAGLE head, exact for greedy chain speculation.

The j-th draft from a verification point is not a teacher-forced prediction (it reads
the head's own h), so chain_steps over first-draft matches would be optimistic or
pessimistic by luck. Instead `EagleHead.unroll` computes, for every root r, the chain's
step j at r + j given that drafts 1..j were right; a verification step from r accepts
the run of steps whose drafts match, then emits the bonus token. `reference_chain` is
the same thing written as a literal drafting loop (used by the tests to pin `unroll`).
"""

from __future__ import annotations

import numpy as np
import torch

from adaserve.distill.data import Sequences
from adaserve.distill.eagle_head import EagleHead


def chain_walk(step_match: np.ndarray, depth: int) -> int:
    """Verification steps to emit a continuation of n tokens. step_match bool [depth, n]:
    step_match[j, i] = the j-th chain draft from the point that has committed
    continuation tokens < i (0-based; draft j predicts token i + j) is right, given
    drafts 0..j-1 were. Each step accepts the leading run of matches (at most `depth`)
    and emits one more token (the target's own), as the model drafter's chain_steps."""
    n = step_match.shape[1]
    i, steps = 0, 0
    while i < n:
        k = 0
        while k < depth and i + k < n and step_match[k, i]:
            k += 1
        i += min(k + 1, n - i)
        steps += 1
    return steps


@torch.no_grad()
def eagle_matches(
    head: EagleHead,
    lm_head: torch.Tensor,  # [V_draft, hidden]: target embedding rows d2t
    d2t: torch.Tensor,
    data: Sequences,
    feats: np.ndarray,  # float16 [len(data.tokens), F * hidden], rows as data.tokens
    depth: int,
) -> tuple[list[np.ndarray], list[int]]:
    """Per sequence: bool [continuation length], whether the head's first draft at each
    continuation position is the target's token (top-1), and the exact number of
    verification steps a width-1 depth-`depth` chain takes over the continuation."""
    matches, steps = [], []
    dev = lm_head.device
    for i in range(len(data)):
        seq = data.seq(i)
        pl, n = int(data.prompt_lens[i]), len(seq)
        if n <= pl:  # kept so results line up with the sequences (summarize skips it)
            matches.append(np.zeros(0, dtype=bool))
            steps.append(0)
            continue
        ids = torch.from_numpy(seq.astype(np.int64))[None].to(dev)
        f = torch.from_numpy(feats[data.offsets[i] : data.offsets[i + 1]].astype(np.float32))
        start = pl - 1  # the first verification point: the last prompt token
        hs = head.unroll(ids, f[None].to(dev), depth, start)
        cont = ids[0, pl:]
        m = np.zeros((depth, n - pl), dtype=bool)
        for j, h in enumerate(hs):
            h = h[0, start:] if j == 0 else h[0]  # positions start.. (root + j)
            pred = d2t[head.logits(h, lm_head).argmax(-1)]
            # step j at position start + r + j drafts continuation token r + j
            m[j, : n - pl - j] = (pred[j : n - pl] == cont[j:]).cpu().numpy()
        matches.append(m[0].copy())
        steps.append(chain_walk(m, depth))
    return matches, steps


@torch.no_grad()
def reference_chain(
    head: EagleHead,
    lm_head: torch.Tensor,
    d2t: torch.Tensor,
    ids: torch.Tensor,  # int64 [T]: committed tokens 0..root
    feats: torch.Tensor,  # [T, F * hidden]: target features of those positions
    depth: int,
) -> list[int]:
    """The greedy chain of `depth` target-token drafts from the last committed token,
    drafted one node at a time the way a server does: rerun the causal head over the
    committed inputs plus the drafted ones (draft token, parent's h)."""
    g = head.fused(feats.float())
    prev = torch.cat([g.new_zeros(1, g.shape[-1]), g[:-1]])
    x = head.inputs(ids, prev)[None]
    drafts: list[int] = []
    for _ in range(depth):
        h = head.run(x)[0, -1]
        tok = d2t[head.logits(h, lm_head).argmax(-1)]
        drafts.append(int(tok))
        x = torch.cat([x, head.inputs(tok[None], h[None])[None]], 1)
    return drafts


def measure_eagle(
    drafter_dir,
    target_dir,
    data: Sequences,
    feats: np.ndarray,  # float16 [len(data.tokens), len(layers) * hidden]
    layers: tuple[int, ...],  # the target layers feats holds, in that order
    depth: int,
) -> tuple[list[np.ndarray], list[int]]:
    """eagle_matches for an exported head, picking its feature layers out of `feats`."""
    from adaserve.distill.eagle_export import load_eagle

    head, lm_head, d2t = load_eagle(drafter_dir, target_dir)
    hidden = head.shape.hidden
    cols = []
    for i in head.feature_layers:
        if i not in layers:
            raise ValueError(f"{drafter_dir}: reads target layer {i}, not captured ({layers})")
        k = layers.index(i)
        cols.append(np.arange(k * hidden, (k + 1) * hidden))
    picked = feats[:, np.concatenate(cols)] if list(layers) != list(head.feature_layers) else feats
    return eagle_matches(head, lm_head, d2t, data, picked, depth)
