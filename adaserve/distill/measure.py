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
from adaserve.drafter import DraftUpdate
from adaserve.ngram import NgramDrafter


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


def summarize(
    matches: Iterable[np.ndarray], depth: int, steps: Iterable[int] | None = None
) -> Acceptance:
    """`steps`: per sequence, verification steps measured directly (a drafter whose
    j-th draft is not its teacher-forced prediction at i + j); else chain_steps."""
    matches = list(matches)
    per_seq = [chain_steps(m, depth) for m in matches] if steps is None else list(steps)
    kept = [(m, s) for m, s in zip(matches, per_seq, strict=True) if len(m)]
    matches = [m for m, _ in kept]
    tokens = sum(len(m) for m in matches)
    total = sum(s for _, s in kept)
    agree = sum(int(m.sum()) for m in matches)
    return Acceptance(
        sequences=len(matches),
        tokens=tokens,
        top1_agreement=agree / max(tokens, 1),
        mean_emitted=tokens / max(total, 1),
        depth=depth,
        steps=total,
    )


@torch.no_grad()
def draft_matches(
    student: LlamaModel,
    head: torch.Tensor,
    d2t: torch.Tensor,
    data: Sequences,
    batch: int = 16,
    context: int | None = None,
) -> list[np.ndarray]:
    """Per sequence: bool [continuation length], whether the drafter's greedy token at
    each continuation position equals the target's. `context`: the drafter reads only
    the last that many prompt tokens (the serving setting speculation.draft_context);
    None: all of them."""
    device = head.device
    out: list[np.ndarray] = []
    cut = [0 if context is None else max(int(n) - context, 0) for n in data.prompt_lens]
    for start in range(0, len(data), batch):
        idx = list(range(start, min(start + batch, len(data))))
        seqs = [data.seq(i)[cut[i] :] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.from_numpy(s.astype(np.int64))
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = student(ids)
        for r, i in enumerate(idx):
            pl, n = int(data.prompt_lens[i]) - cut[i], len(seqs[r])
            h = hidden[r, pl - 1 : n - 1]  # predicts tokens pl .. n-1
            pred = d2t[student.logits(h.float(), head.float()).argmax(-1)]
            out.append((pred == ids[r, pl:n]).cpu().numpy())
    return out


def ngram_matches(
    data: Sequences, depth: int, drafter: NgramDrafter | None = None
) -> tuple[list[np.ndarray], list[int]]:
    """The n-gram drafter on each (prompt, target continuation): per sequence, whether
    its most likely first token at each continuation position is the target's (no
    proposal: a miss), and the verification steps a width-1 depth-`depth` chain takes.

    Its drafts come from one match's continuation, not from a fresh prediction at each
    position, so the steps are simulated: draft from the committed tokens, accept the
    run of matching tokens, emit one more, repeat. Exact for greedy chain speculation."""
    drafter = drafter or NgramDrafter()
    matches, steps = [], []
    for i in range(len(data)):
        first, count = _ngram_sequence(drafter, data.seq(i), int(data.prompt_lens[i]), depth)
        matches.append(first)
        steps.append(count)
    return matches, steps


def _ngram_sequence(
    drafter: NgramDrafter, seq: np.ndarray, prompt_len: int, depth: int
) -> tuple[np.ndarray, int]:
    n = len(seq)
    have = 0  # tokens the drafter holds: updates carry only the new ones

    def draft(pos: int, d: int) -> np.ndarray:
        nonlocal have
        (tree,) = drafter.speculate([DraftUpdate("m", seq[have:pos], pos)], d, 1)
        have = pos
        return tree.tokens[1:]

    first = np.zeros(n - prompt_len, dtype=bool)
    for pos in range(prompt_len, n):  # top-1 agreement: one proposal per position
        guess = draft(pos, 1)
        first[pos - prompt_len] = guess.shape[0] > 0 and int(guess[0]) == int(seq[pos])
    drafter.release(["m"])
    have, pos, count = 0, prompt_len, 0
    while pos < n:
        chain = draft(pos, depth)
        k = 0
        while k < chain.shape[0] and pos + k < n and chain[k] == seq[pos + k]:
            k += 1
        pos += min(k + 1, n - pos)
        count += 1
    drafter.release(["m"])
    return first, count
