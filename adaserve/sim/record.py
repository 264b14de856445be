"""Recording acceptance traces from the real runtime, for the simulator's replay mode.

Runs greedy speculative decoding with the real BeamDrafter and target runner over a
few prompts. For every tree node that has children, the target's choice there (argmax
of its logits after the node's path) is compared with the children's tokens, and one
JSON line is written:

    {"probs": [q of each child, descending], "chosen": index of the child the target
     picked or -1, "full": true when the node kept all w children (its true top-w)}

That is exactly what the acceptance model needs: P(target picks child | q) for the
calibration, and the drafter's top-w vectors (`full` lines) for the draft distribution.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np

# Short prompts in the three workload categories, used when the target has a tokenizer.
DEFAULT_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Write a Python function that checks whether a string is a palindrome.",
    "Give three tips for staying healthy.",
    "Explain why the sky is blue to a ten-year-old.",
    "Summarize: The city council voted on Tuesday to expand the bike lane network, "
    "adding 40 kilometres of protected lanes over the next three years.",
    "What is the capital of France, and what is it famous for?",
)


def record_trace(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    out: IO[str],
    depth: int = 4,
    width: int = 2,
    steps: int = 32,
) -> int:
    """Decode every prompt for `steps` iterations; returns the number of lines written."""
    from adaserve.drafter import DraftUpdate
    from adaserve.model.runner import SeqInput
    from adaserve.speculate import BeamDrafter

    beam = BeamDrafter(drafter)
    ids = [f"rec{i}" for i in range(len(prompts))]
    history = {sid: [int(t) for t in p] for sid, p in zip(ids, prompts, strict=True)}
    new = {sid: list(h) for sid, h in history.items()}
    # Prefill all but the last prompt token: the last one is the first root.
    for sid in ids:
        target.add_sequence(sid)
        body = history[sid][:-1]
        if body:
            target.forward([SeqInput.chain(sid, body)], logits_indices=[len(body) - 1])
            target.commit(sid, range(len(body)))
    written = 0
    limit = target.max_model_len - depth - 2
    for _ in range(steps):
        live = [sid for sid in ids if len(history[sid]) < limit]
        if not live:
            break
        updates = [
            DraftUpdate(sid, np.asarray(new[sid], np.int32), len(history[sid])) for sid in live
        ]
        trees = beam.speculate(updates, depth, width)
        inputs = [SeqInput(sid, t.tokens, t.parents) for sid, t in zip(live, trees, strict=True)]
        choice = target.forward(inputs).argmax(dim=-1).cpu().numpy()
        start = 0
        for sid, tree in zip(live, trees, strict=True):
            n = len(tree)
            c = choice[start : start + n]
            start += n
            written += _write_nodes(tree, c, width, out)
            path = _greedy_path(tree, c)
            target.commit(sid, path)
            emitted = [int(tree.tokens[v]) for v in path[1:]] + [int(c[path[-1]])]
            history[sid].extend(emitted)
            new[sid] = emitted
    for sid in ids:
        target.free(sid)
    beam.release(ids)
    return written


def _children(tree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(tree))]
    for v in range(1, len(tree)):
        kids[int(tree.parents[v])].append(v)
    return kids


def _write_nodes(tree, choice: np.ndarray, width: int, out: IO[str]) -> int:
    q = np.exp(tree.logprobs.astype(np.float64))
    lines = 0
    for v, kids in enumerate(_children(tree)):
        if not kids:
            continue
        kids = sorted(kids, key=lambda k: -q[k])
        chosen = next((i for i, k in enumerate(kids) if tree.tokens[k] == choice[v]), -1)
        rec = {
            "probs": [round(float(q[k]), 6) for k in kids],
            "chosen": chosen,
            "full": len(kids) == width,
        }
        out.write(json.dumps(rec) + "\n")
        lines += 1
    return lines


def _greedy_path(tree, choice: np.ndarray) -> list[int]:
    kids = _children(tree)
    path = [0]
    while True:
        nxt = [k for k in kids[path[-1]] if tree.tokens[k] == choice[path[-1]]]
        if not nxt:
            return path
        path.append(min(nxt))


def prompt_ids(
    tokenizer,
    vocab_size: int,
    count: int,
    seed: int = 0,
    random_ids: tuple[int, int] | None = None,
    length: int = 24,
) -> list[list[int]]:
    """Tokenized default prompts; random token ids when there is no tokenizer or when
    `random_ids` = (lo, hi) asks for them (`adaserve bench serve` sends ids drawn from
    such a range, so a trace meant to replay a benchmark run records the same kind)."""
    if tokenizer is not None and random_ids is None:
        return [list(tokenizer.encode(p))[:256] for p in DEFAULT_PROMPTS[:count]] or [[1]]
    lo, hi = random_ids if random_ids is not None else (0, vocab_size)
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, min(hi, vocab_size), size=length).tolist() for _ in range(count)]


def write_trace(path: Path, *args, **kwargs) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        return record_trace(*args, out=f, **kwargs)
