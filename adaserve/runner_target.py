"""`TargetModel` over the model runner: one forward verifies the selected trees,
prefills the prompt chunks and samples the first token of each prompt a chunk completes
(the interface: adaserve/target.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from adaserve.logits_process import process_rows_, scored_logprobs, token_logprobs
from adaserve.request import TokenLogprobs
from adaserve.sampling import TokenRng
from adaserve.target import ForwardResult, PrefillChunk, VerifyItem
from adaserve.tree import CandidateTree
from adaserve.verify import verify_batch, verify_tree


def _process(logits: torch.Tensor, trees: Sequence[VerifyItem]) -> dict[int, torch.Tensor]:
    """Applies each request's processors to its own rows of `logits`, in place, and
    returns (by tree index) the raw rows of the requests that also want logprobs, copied
    before: logprobs are the model's own distribution."""
    raw: dict[int, torch.Tensor] = {}
    offset = 0
    # The runner's logits are inference tensors: they may be updated in place only in
    # inference mode.
    with torch.inference_mode():
        for i, it in enumerate(trees):
            n = len(it.tree)
            if it.logits is not None:
                rows = logits[offset : offset + n]
                if it.sampling.logprobs is not None:
                    raw[i] = rows.clone()
                process_rows_(rows, it.tree.parents, it.tree.tokens, it.logits)
            offset += n
    return raw


def _no_logprobs(k: int) -> TokenLogprobs:
    return TokenLogprobs(
        np.zeros(0, np.float32),
        np.zeros((0, k), np.int32),
        np.zeros((0, k), np.float32),
        np.zeros(0, np.int32),
    )


class RunnerTarget:
    """TargetModel over an `adaserve.model.runner.ModelRunner`."""

    def __init__(self, runner, eos_token_ids: Sequence[int]) -> None:
        self.runner = runner
        self.vocab_size = int(runner.vocab_size)
        self.max_model_len = int(runner.max_model_len)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.block_size = int(runner.block_size)
        self.num_blocks = int(runner.num_blocks)
        # Target layers whose outputs an EAGLE drafter reads; () computes none.
        self.feature_layers: tuple[int, ...] = ()

    def return_features(
        self, layers: Sequence[int], target_layers: int = -1, hidden_size: int = -1
    ) -> None:
        """Return the features of `layers` with every forward from now on (see
        ForwardResult.tree_features). Needs a runner that computes them (ModelRunner,
        and TPRunner with rank 0's replicated ones): ValueError otherwise."""
        if layers and not hasattr(self.runner, "forward_features"):
            raise ValueError(
                f"an EAGLE drafter needs the target's hidden states, which "
                f"{type(self.runner).__name__} does not return (use tp 1)"
            )
        n, h = int(self.runner.config.num_layers), int(self.runner.config.hidden_size)
        # The head names the target it was trained on by its shape (-1: not told).
        if target_layers not in (-1, n) or hidden_size not in (-1, h):
            raise ValueError(
                f"the EAGLE head was trained on a target of {target_layers} layers of "
                f"{hidden_size}; this target has {n} of {h}: wrong target?"
            )
        if any(not 0 <= int(i) < n for i in layers):
            raise ValueError(f"feature layers {list(layers)} outside the target's {n} layers")
        self.feature_layers = tuple(int(i) for i in layers)

    def add_sequence(self, seq_id: str, tokens: Sequence[int], use_cache: bool = True) -> int:
        return self.runner.add_sequence(seq_id, tokens, use_cache)

    def forward(self, trees: Sequence[VerifyItem], chunks: Sequence[PrefillChunk]) -> ForwardResult:
        from adaserve.model.runner import SeqInput

        inputs = [SeqInput(it.seq_id, it.tree.tokens, it.tree.parents) for it in trees]
        inputs += [SeqInput.chain(c.seq_id, c.tokens, prefill=True) for c in chunks]
        # Logits for every tree node and for the last row of each completed prompt: the
        # LM head is skipped for the rest of the chunk rows, but for the rows of chunks
        # that score their prompt (prompt logprobs).
        rows = list(range(sum(len(it.tree) for it in trees)))
        pos = len(rows)
        finals = []
        scoring: list[int | None] = []  # per chunk: where its scored rows start in rows
        for c in chunks:
            if c.scored is not None and len(c.scored):
                scoring.append(len(rows))
                rows.extend(range(pos, pos + len(c.scored)))
            else:
                scoring.append(None)
            pos += len(c.tokens)
            if c.last:
                finals.append(len(rows))
                rows.append(pos - 1)
        feats = None
        if self.feature_layers:  # KVCacheFull: nothing done
            logits, feats = self.runner.forward_features(inputs, self.feature_layers, rows)
        else:
            logits = self.runner.forward(inputs, logits_indices=rows)
        n_tree = sum(len(it.tree) for it in trees)
        raw = _process(logits[:n_tree], trees)
        verified = verify_batch(
            [it.tree for it in trees],
            logits[:n_tree],
            [it.sampling for it in trees],
            [it.generator for it in trees],
            eos_token_ids=self.eos_token_ids,
            max_new=[it.max_new for it in trees],
        )
        offset = 0
        for i, (it, res) in enumerate(zip(trees, verified, strict=True)):
            k = it.sampling.logprobs
            if k is not None:  # each emitted token scored by the row that chose it
                own = raw[i] if i in raw else logits[offset : offset + len(it.tree)]
                chose = own[torch.as_tensor(res.accepted_nodes, dtype=torch.int64)]
                verified[i] = replace(res, logprobs=token_logprobs(chose, res.emitted_tokens, k))
            offset += len(it.tree)
            self.runner.commit(it.seq_id, res.accepted_nodes)
        first: list[int | None] = []
        first_lp: list[TokenLogprobs | None] = []
        prompt_lp: list[TokenLogprobs | None] = []
        finals_iter = iter(finals)
        root = CandidateTree.root_only(0)  # token unused: only its logits matter
        for c, at in zip(chunks, scoring, strict=True):
            self.runner.commit(c.seq_id, range(len(c.tokens)))
            if c.scored is None:
                prompt_lp.append(None)
            elif at is None:  # a one-token last chunk scores nothing
                prompt_lp.append(_no_logprobs(c.prompt_logprobs))
            else:  # one chunk's [rows, V] at most, reduced to top-k on the device
                block = logits[at : at + len(c.scored)]
                prompt_lp.append(scored_logprobs(block, c.scored, c.prompt_logprobs))
            if not c.last:
                first.append(None)
                first_lp.append(None)
                continue
            final = next(finals_iter)
            row = logits[final : final + 1]
            k = c.sampling.logprobs
            raw_row = row.clone() if k is not None and c.logits is not None else row
            if c.logits is not None:
                with torch.inference_mode():
                    process_rows_(row, root.parents, root.tokens, c.logits)
            res = verify_tree(root, row, c.sampling, c.generator, eos_token_ids=self.eos_token_ids)
            first.append(int(res.emitted_tokens[0]))
            first_lp.append(None if k is None else token_logprobs(raw_row, res.emitted_tokens, k))
        result = ForwardResult(verified, first, first_lp, prompt_lp)
        if feats is not None:
            result = _with_features(result, feats, trees, chunks)
        return result

    def free(self, seq_id: str) -> None:
        self.runner.free(seq_id)

    def free_blocks(self) -> int:
        return int(self.runner.free_blocks())

    def blocks_needed(self, growth: dict[str, int]) -> int:
        return int(self.runner.blocks_needed(growth))

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.runner.prefix_cache_stats()

    def kv_usage(self) -> float:
        return float(self.runner.kv_usage())

    def make_generator(self, seed: int | None) -> TokenRng:
        # Counter-based stream: a seeded request samples the same tokens whatever the
        # batch or the tree shapes (see adaserve/sampling.py).
        return TokenRng(seed)


def _with_features(
    result: ForwardResult,
    feats: torch.Tensor,
    trees: Sequence[VerifyItem],
    chunks: Sequence[PrefillChunk],
) -> ForwardResult:
    """The result with each tree's root-and-accepted rows and each chunk's rows of the
    forward's features, float16 on the host (what goes to the drafter)."""
    # float16 on the wire; a value past its range (a model's outlier activations) is
    # clipped to it rather than becoming inf, which the drafter would refuse.
    fp16_max = torch.finfo(torch.float16).max
    host = feats.float().clamp(-fp16_max, fp16_max).to(torch.float16).cpu().numpy()
    per_tree, offset = [], 0
    for it, res in zip(trees, result.verified, strict=True):
        per_tree.append(host[offset + res.accepted_nodes.astype(np.int64)])
        offset += len(it.tree)
    per_chunk = []
    for c in chunks:
        per_chunk.append(host[offset : offset + len(c.tokens)])
        offset += len(c.tokens)
    return replace(result, tree_features=per_tree, chunk_features=per_chunk)
