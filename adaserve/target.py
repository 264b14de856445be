"""The verifier side of an iteration, as the engine sees it.

`TargetModel` hides logits from the engine: one forward per iteration verifies the
selected trees, commits the accepted KV, prefills chunks of prompts and samples the
first token of each prompt a chunk completes. `RunnerTarget` (adaserve/runner_target.py)
does that on the real model runner; the simulator substitutes a modelled target with the
same interface. No torch here: the engine's planning and the simulator import it without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from adaserve.request import SamplingParams, TokenLogprobs
from adaserve.tree import CandidateTree

if TYPE_CHECKING:
    from adaserve.sampling import TokenRng


@dataclass(frozen=True)
class VerifyResult:
    # emitted_tokens[i] is the target's choice at accepted_nodes[i]: so accepted_nodes is
    # what the runner commits (keep=accepted_nodes) and emitted_tokens[-1] is the next root.
    accepted_nodes: np.ndarray  # int32 [m]: 0, then accepted drafted nodes in path order
    emitted_tokens: np.ndarray  # int32 [m]: accepted drafted tokens, then the bonus token
    finish_reason: str | None = None  # None | "stop" (stop token emitted) | "length"
    logprobs: TokenLogprobs | None = None  # of emitted_tokens, when the request asked

    @property
    def num_accepted_drafts(self) -> int:
        """Drafted tokens the target agreed with (the bonus token excluded)."""
        return int(self.accepted_nodes.shape[0]) - 1


@dataclass(frozen=True)
class LogitsContext:
    """What one request's rows need: its settings, its committed history and, with
    structured output, the grammar's mask at every row."""

    sampling: SamplingParams
    prompt: np.ndarray  # int32 [P]
    output: np.ndarray  # int32 [G]: tokens generated so far (committed)
    stop_ids: tuple[int, ...]  # what min_tokens holds back: eos unless ignore_eos, stop ids
    masks: np.ndarray | None = None  # int32 [rows, ceil(V / 32)] bitmask per row; None: none


@dataclass(frozen=True)
class VerifyItem:
    seq_id: str
    tree: CandidateTree  # the selected tree; node 0 is the root (not yet in target KV)
    sampling: SamplingParams
    generator: TokenRng | None  # the request's random stream (sampling only)
    max_new: int  # tokens the request may still emit
    # Penalties, bias, grammar masks...: every row processed from its own history
    # (adaserve/logits_process.py); None: the raw logits are the distribution.
    logits: LogitsContext | None = None


@dataclass(frozen=True)
class PrefillChunk:
    """The next prompt tokens of a request being prefilled (its sequence was added)."""

    seq_id: str
    tokens: np.ndarray  # int32 [k]: prompt tokens start .. start + k - 1
    start: int  # position of tokens[0]: what the sequence already holds
    last: bool  # the chunk ends the prompt: its last row gives the first output token
    sampling: SamplingParams
    generator: TokenRng | None
    logits: LogitsContext | None = None  # processing of the first token's row (last chunk)
    # Prompt logprobs: the prompt tokens this chunk's rows score (row i scores the token
    # after tokens[i]: tokens[1:] and the next chunk's first, so one fewer in the last
    # chunk) and the top-k to return; None: not asked.
    scored: np.ndarray | None = None
    prompt_logprobs: int = 0


@dataclass(frozen=True)
class ForwardResult:
    verified: list[VerifyResult]  # one per tree, in order
    first_tokens: list[int | None]  # one per chunk: the first output token of a last chunk
    # one per chunk, where its request asked for logprobs and it gave a first token
    first_logprobs: list[TokenLogprobs | None] | None = None
    # one per chunk, where it asked for prompt logprobs (`PrefillChunk.scored`): the
    # scored tokens' logprobs, ranks and top-k (raw log-softmax)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Where the target returns features (`feature_layers`, an EAGLE drafter in use):
    # float16 [len(accepted_nodes), F*H] per tree (its root and accepted path), and
    # float16 [len(tokens), F*H] per chunk; None otherwise.
    tree_features: list[np.ndarray] | None = None
    chunk_features: list[np.ndarray] | None = None


class TargetModel(Protocol):
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in all

    def add_sequence(self, seq_id: str, tokens: Sequence[int], use_cache: bool = True) -> int:
        """Start a request's KV sequence for the prompt `tokens`; returns how many of
        them the prefix cache holds already (the rest is prefilled in chunks). With
        `use_cache` False none are taken from it (prompt logprobs need every row)."""
        ...

    def forward(self, trees: Sequence[VerifyItem], chunks: Sequence[PrefillChunk]) -> ForwardResult:
        """One forward over the selected trees and the prefill chunks: verify each tree
        and commit its accepted path, commit each chunk's KV, and sample the first
        token of every prompt that a chunk completes."""
        ...

    def free(self, seq_id: str) -> None: ...

    def free_blocks(self) -> int:
        """KV blocks a forward can still take."""
        ...

    def blocks_needed(self, growth: dict[str, int]) -> int:
        """New KV blocks the sequences need for `growth[id]` more tokens each."""
        ...

    def kv_usage(self) -> float: ...

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, tokens found) in the prefix cache so far."""
        ...

    def make_generator(self, seed: int | None) -> TokenRng | None: ...
