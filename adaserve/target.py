"""The verifier side of an iteration, as the engine sees it.

`TargetModel` hides logits from the engine: it prefills prompts, verifies selected
trees and commits the accepted KV. `RunnerTarget` does that on the real model runner;
the simulator substitutes a modelled target with the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from adaserve.request import SamplingParams
from adaserve.sampling import TokenRng
from adaserve.tree import CandidateTree
from adaserve.verify import VerifyResult, verify_batch, verify_tree


@dataclass(frozen=True)
class VerifyItem:
    seq_id: str
    tree: CandidateTree  # the selected tree; node 0 is the root (not yet in target KV)
    sampling: SamplingParams
    generator: TokenRng | None  # the request's random stream (sampling only)
    max_new: int  # tokens the request may still emit


class TargetModel(Protocol):
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def prefill(
        self, items: Sequence[tuple[str, Sequence[int], SamplingParams, TokenRng | None]]
    ) -> list[int]:
        """Commit each prompt's KV and return each request's first generated token."""
        ...

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]: ...

    def free(self, seq_id: str) -> None: ...

    def can_reserve(self, total_tokens: int) -> bool:
        """Whether the KV cache can hold `total_tokens` tokens spread over the running
        requests (the engine reserves each request's maximum at admission)."""
        ...

    def kv_usage(self) -> float: ...

    def make_generator(self, seed: int | None) -> TokenRng | None: ...


class RunnerTarget:
    """TargetModel over an `adaserve.model.runner.ModelRunner`."""

    def __init__(self, runner, eos_token_ids: Sequence[int], prefill_chunk: int = 512) -> None:
        self.runner = runner
        self.vocab_size = int(runner.vocab_size)
        self.max_model_len = int(runner.max_model_len)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.prefill_chunk = prefill_chunk

    def prefill(self, items) -> list[int]:
        for seq_id, *_ in items:
            self.runner.add_sequence(seq_id)
        # Chunk long prompts; every chunk of every prompt rides in one forward per round.
        last_logits: dict[str, torch.Tensor] = {}
        pending = {seq_id: np.asarray(tokens, dtype=np.int32) for seq_id, tokens, *_ in items}
        offset = 0
        while pending:
            inputs, owners = [], []
            for seq_id, toks in pending.items():
                chunk = toks[offset : offset + self.prefill_chunk]
                inputs.append(_chain_input(seq_id, chunk))
                owners.append((seq_id, len(chunk)))
            logits = self.runner.forward(inputs, last_only=True)
            for (seq_id, n), row in zip(owners, logits, strict=True):
                self.runner.commit(seq_id, range(n))
                last_logits[seq_id] = row
            offset += self.prefill_chunk
            pending = {s: t for s, t in pending.items() if len(t) > offset}
        first = []
        for seq_id, _, sampling, generator in items:
            root = CandidateTree.root_only(0)  # token unused: only its logits matter
            res = verify_tree(
                root,
                last_logits[seq_id][None],
                sampling,
                generator,
                eos_token_ids=self.eos_token_ids,
            )
            first.append(int(res.emitted_tokens[0]))
        return first

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        from adaserve.model.runner import SeqInput

        inputs = [SeqInput(it.seq_id, it.tree.tokens, it.tree.parents) for it in items]
        logits = self.runner.forward(inputs)
        results = verify_batch(
            [it.tree for it in items],
            logits,
            [it.sampling for it in items],
            [it.generator for it in items],
            eos_token_ids=self.eos_token_ids,
            max_new=[it.max_new for it in items],
        )
        for it, res in zip(items, results, strict=True):
            self.runner.commit(it.seq_id, res.accepted_nodes)
        return results

    def free(self, seq_id: str) -> None:
        self.runner.free(seq_id)

    def can_reserve(self, total_tokens: int) -> bool:
        cache = self.runner.cache
        # One partly filled block per sequence is the worst-case fragmentation.
        slack = (len(cache.seqs) + 1) * cache.block_size
        return total_tokens + slack <= cache.allocator.num_blocks * cache.block_size

    def kv_usage(self) -> float:
        return float(self.runner.kv_usage())

    def make_generator(self, seed: int | None) -> TokenRng:
        # Counter-based stream: a seeded request samples the same tokens whatever the
        # batch or the tree shapes (see adaserve/sampling.py).
        return TokenRng(seed)


def _chain_input(seq_id: str, tokens: np.ndarray):
    from adaserve.model.runner import SeqInput

    return SeqInput(seq_id, tokens, np.arange(-1, len(tokens) - 1, dtype=np.int32))
