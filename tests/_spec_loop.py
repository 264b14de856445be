"""A minimal speculate -> select -> verify -> commit loop for the lossless tests.

It drives the real pieces (ModelRunner, BeamDrafter or a tree function, selection,
verify_batch) for a batch of requests, without the engine's threads, admission and
streaming, so a failure points at the runtime, the drafter or the verifier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from adaserve.drafter import DraftUpdate
from adaserve.model.runner import SeqInput
from adaserve.request import SamplingParams
from adaserve.sampling import TokenRng
from adaserve.selection import RequestProgress, SelectionParams, select
from adaserve.tree import CandidateTree
from adaserve.verify import verify_batch, verify_tree

# (request id, committed tokens so far, numpy rng) -> candidate tree rooted at tokens[-1]
TreeFn = Callable[[str, list[int], np.random.Generator], CandidateTree]


@dataclass
class LoopStats:
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per tree
    tree_sizes: list[int] = field(default_factory=list)  # selected nodes per tree

    @property
    def mean_emitted(self) -> float:
        return 1.0 + float(np.mean(self.accepted)) if self.accepted else 0.0


def generate(
    target,
    prompts: dict[str, list[int]],
    max_tokens: int,
    *,
    drafter=None,
    tree_fn: TreeFn | None = None,
    depth: int = 0,
    width: int = 1,
    budget: Callable[[int, np.random.Generator], int] | None = None,
    sp: SamplingParams | dict[str, SamplingParams] | None = None,
    rngs: dict[str, TokenRng] | None = None,
    seed: int = 0,
    free: bool = True,
    policy: str = "adaserve",
) -> tuple[dict[str, list[int]], LoopStats]:
    """Generate `max_tokens` tokens per prompt (eos ignored); returns new tokens per id.

    Trees come from `drafter` (BeamDrafter, depth x width) or `tree_fn`, else root-only
    (plain decoding). `budget(n, rng)` picks the verifier budget each step (>= n);
    `policy` is the selection policy (`global` verifies every node the budget fits:
    tests of acceptance itself use it, since `adaserve` may stop short of the budget).
    """
    sp = sp or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sps = sp if isinstance(sp, dict) else {i: sp for i in prompts}
    rng = np.random.default_rng(seed)
    rngs = rngs if rngs is not None else {}
    ids = list(prompts)
    tokens = {i: list(prompts[i]) for i in ids}
    out: dict[str, list[int]] = {i: [] for i in ids}
    drafted: dict[str, int] = {i: 0 for i in ids}
    stats = LoopStats()

    # Prefill: the whole prompt minus its last token is committed; the last token is
    # the first root, so the first output token comes from the first verification.
    for i in ids:
        target.add_sequence(i)
    long = [i for i in ids if len(prompts[i]) > 1]
    if long:
        target.forward([SeqInput.chain(i, prompts[i][:-1]) for i in long])
        for i in long:
            target.commit(i, range(len(prompts[i]) - 1))

    live = list(ids)
    while live:
        if drafter is not None:
            updates = [
                DraftUpdate(i, np.asarray(tokens[i][drafted[i] :], np.int32), len(tokens[i]))
                for i in live
            ]
            trees = drafter.speculate(updates, depth, width)
            for i in live:
                drafted[i] = len(tokens[i])
        elif tree_fn is not None:
            trees = [tree_fn(i, tokens[i], rng) for i in live]
        else:
            trees = [CandidateTree.root_only(tokens[i][-1]) for i in live]
        for i, t in zip(live, trees, strict=True):
            assert int(t.tokens[0]) == tokens[i][-1], "tree root must be the last token"
        selected = _select(live, trees, depth, budget, rng, policy)
        logits = target.forward(
            [SeqInput(i, t.tokens, t.parents) for i, t in zip(live, selected, strict=True)]
        )
        caps = [max_tokens - len(out[i]) for i in live]
        results = verify_batch(
            selected, logits, [sps[i] for i in live], [rngs.get(i) for i in live], max_new=caps
        )
        stats.steps += 1
        for i, t, res in zip(live, selected, results, strict=True):
            target.commit(i, res.accepted_nodes.tolist())
            emitted = res.emitted_tokens.tolist()
            out[i].extend(emitted)
            tokens[i].extend(emitted)
            stats.accepted.append(res.num_accepted_drafts)
            stats.tree_sizes.append(len(t))
        done = [i for i in live if len(out[i]) >= max_tokens]
        for i in done:
            if free:
                target.free(i)
                if drafter is not None:
                    drafter.release([i])
        live = [i for i in live if i not in done]
    return out, stats


def _select(live, trees, depth, budget, rng, policy: str) -> list[CandidateTree]:
    if budget is None or all(len(t) == 1 for t in trees):
        return trees
    n = len(live)
    progress = [
        RequestProgress(
            i, float(rng.uniform(5, 100)), float(rng.uniform(0, 500)), int(rng.integers(0, 20))
        )
        for i in live
    ]
    params = SelectionParams(
        budget=max(n, budget(n, rng)),
        depth=depth,
        t_spec_ms=float(rng.uniform(1, 50)),
        policy=policy,
    )
    sel = select(progress, trees, params)
    return [t.subtree(idx) for t, idx in zip(trees, sel.selected, strict=True)]


def random_budget(n: int, rng: np.random.Generator) -> int:
    """Budget 1 per root (root-only trees) a quarter of the time, else up to 12 per root."""
    return n if rng.random() < 0.25 else int(rng.integers(n, 12 * n + 1))


def hf_greedy(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    """Hugging Face transformers greedy decoding, eos disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return ids[0, len(prompt) :].tolist()


def plain_greedy_verify(target, seq_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference plain decoding: one root-only verify_tree per token."""
    target.add_sequence(seq_id)
    if len(prompt) > 1:
        target.forward([SeqInput.chain(seq_id, prompt[:-1])])
        target.commit(seq_id, range(len(prompt) - 1))
    out, last = [], prompt[-1]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    while len(out) < max_tokens:
        root = CandidateTree.root_only(last)
        res = verify_tree(root, target.forward([SeqInput(seq_id, root.tokens, root.parents)]), sp)
        target.commit(seq_id, res.accepted_nodes.tolist())
        last = int(res.emitted_tokens[0])
        out.append(last)
    target.free(seq_id)
    return out
