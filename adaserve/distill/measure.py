"""Acceptance of a drafter against its target on (prompt, target-greedy continuation)
pairs, computed teacher-forced.

Exact for greedy chain speculation: while drafts match, the drafter's inputs are the
target's own tokens, so its j-th draft from position i equals its teacher-forced
prediction at i + j. A verification step from position i therefore accepts the run of
consecutive matches starting at i (at most `depth`) and emits one more (the bonus).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from adaserve.distill.data import Sequences
from adaserve.distill.llama import LlamaModel


@dataclass(frozen=True)
class Acceptance:
    sequences: int
    tokens: int
    top1_agreement: float  # drafter argmax == target greedy token, over continuation tokens
    mean_emitted: float  # tokens per verification step, bonus included (depth-`depth` chain)
    depth: int
    steps: int

    def as_dict(self) -> dict:
        return asdict(self)


def chain_steps(match: np.ndarray, depth: int) -> int:
    """Verification steps to emit len(match) tokens with a width-1 depth-`depth` chain."""
    n, i, steps = len(match), 0, 0
    while i < n:
        k = 0
        while k < depth and i + k < n and match[i + k]:
            k += 1
        i += min(k + 1, n - i)
        steps += 1
    return steps


def summarize(matches: Iterable[np.ndarray], depth: int) -> Acceptance:
    matches = [m for m in matches if len(m)]
    tokens = sum(len(m) for m in matches)
    steps = sum(chain_steps(m, depth) for m in matches)
    agree = sum(int(m.sum()) for m in matches)
    return Acceptance(
        sequences=len(matches),
        tokens=tokens,
        top1_agreement=agree / max(tokens, 1),
        mean_emitted=tokens / max(steps, 1),
        depth=depth,
        steps=steps,
    )


@torch.no_grad()
def draft_matches(
    student: LlamaModel,
    head: torch.Tensor,
    d2t: torch.Tensor,
    data: Sequences,
    batch: int = 16,
) -> list[np.ndarray]:
    """Per sequence: bool [continuation length], whether the drafter's greedy token at
    each continuation position equals the target's."""
    device = head.device
    out: list[np.ndarray] = []
    for start in range(0, len(data), batch):
        idx = list(range(start, min(start + batch, len(data))))
        seqs = [data.seq(i) for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.from_numpy(s.astype(np.int64))
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = student(ids)
        for r, i in enumerate(idx):
            pl, n = int(data.prompt_lens[i]), len(seqs[r])
            h = hidden[r, pl - 1 : n - 1]  # predicts tokens pl .. n-1
            pred = d2t[student.logits(h.float(), head.float()).argmax(-1)]
            out.append((pred == ids[r, pl:n]).cpu().numpy())
    return out
