"""ModelRunner: the decoder plus its paged KV cache, driven by token trees.

Each sequence has a committed prefix (KV cached) and, during an iteration, scratch
nodes: tokens whose KV is computed by `forward` and kept in slots after the prefix
until `commit` keeps one chain of them and drops the rest. A forward over a batch of
sequences builds one `AttentionBatch` (slots, visibility) and one backend metadata
object, then runs the layers once for all new nodes of all sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adaserve.model.attention import AttentionBackend, AttentionBatch
from adaserve.model.config import ModelConfig
from adaserve.model.kv_cache import KVCacheFull, PagedKVCache
from adaserve.model.llama import LlamaModel

__all__ = ["ForwardBatch", "KVCacheFull", "ModelRunner", "SeqInput"]


@dataclass(frozen=True)
class SeqInput:
    seq_id: str
    tokens: np.ndarray  # int32 [k]: new nodes appended to this sequence's scratch
    parents: np.ndarray  # int32 [k]: index into the sequence's scratch nodes (earlier
    # calls' scratch first, then these), or -1 = child of the committed prefix.
    # Position = committed_len + depth.
    prefill: bool = False  # a prompt chunk, not tree nodes: attention may take another path

    @staticmethod
    def chain(seq_id: str, tokens: Sequence[int] | np.ndarray, prefill: bool = False) -> SeqInput:
        """A prefill chunk / plain decode step: each token the child of the previous."""
        k = len(tokens)
        return SeqInput(
            seq_id,
            np.asarray(tokens, dtype=np.int32),
            np.arange(-1, k - 1, dtype=np.int32),
            prefill,
        )


@dataclass(frozen=True)
class ForwardBatch:
    """One forward as the host built it (`ModelRunner.prepare`), before the device runs
    it (`ModelRunner.execute`)."""

    attention: AttentionBatch
    ids: np.ndarray  # int64 [T]: token ids, packed in input order
    positions: np.ndarray  # int64 [T]
    logits_rows: np.ndarray | None  # int64 [R]: packed rows whose logits are wanted; None: all


class ModelRunner:
    """Single-process runner (also one rank's part under tensor parallelism)."""

    def __init__(
        self,
        model: LlamaModel,
        config: ModelConfig,
        cache: PagedKVCache,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.config = config
        self.cache = cache
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size  # input ids; logits have lm_head rows
        # int64 [V_draft]: target id of each logit column for a reduced-vocab drafter
        self.draft_to_target: torch.Tensor | None = None
        # What its weights run as (model.quantization, decided: none | int8 | stored),
        # and with stored the count of linear layers per GGUF format.
        self.quantization = "none"
        self.weight_formats: dict[str, int] = {}

    # -- sequence lifecycle ------------------------------------------------------------

    def add_sequence(self, seq_id: str, tokens: Sequence[int] = (), use_cache: bool = True) -> int:
        """Start a sequence that will hold `tokens` (its prompt, when known): returns how
        many leading tokens the prefix cache already holds (committed from the start;
        the caller forwards the rest). `use_cache` False: 0, nothing looked up (a
        request scoring its prompt needs every row); what it computes is still cached."""
        return self.cache.add(seq_id, [int(t) for t in tokens], use_cache)

    def committed_len(self, seq_id: str) -> int:
        return self.cache.get(seq_id).committed

    def scratch_len(self, seq_id: str) -> int:
        return self.cache.get(seq_id).scratch_len

    def commit(self, seq_id: str, keep: Sequence[int]) -> None:
        """`keep`: scratch indices forming a chain off the committed prefix, in order;
        their KV becomes committed, the rest of the scratch is dropped."""
        self.cache.commit(seq_id, [int(s) for s in keep])

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks; unknown ids are ignored (abort paths race)."""
        self.cache.free(seq_id)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether one new sequence of `num_tokens` fits in the free blocks right now."""
        return self.cache.can_allocate(num_tokens)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def free_blocks(self) -> int:
        """Blocks a forward can still take (cached blocks nobody holds included)."""
        return self.cache.blocks.num_free

    def blocks_needed(self, growth: dict[str, int]) -> int:
        """New blocks the sequences need for `growth[id]` more tokens each."""
        return self.cache.blocks.blocks_needed(
            {sid: self.cache.get(sid).total_len + n for sid, n in growth.items()}
        )

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(tokens looked up, tokens found) in the prefix cache so far."""
        st = self.cache.blocks.stats
        return st.queries, st.hits

    def kv_usage(self) -> float:
        return self.cache.usage()

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self.cache.seqs

    # -- forward -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        inputs: list[SeqInput],
        logits_indices: Sequence[int] | None = None,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits float32 [sum k, vocab] for every new node (packed in input order);
        with `logits_indices` only those rows of the packed new nodes, with `last_only`
        each sequence's last new node ([len(inputs), vocab]). Skipping rows skips
        their LM head, which dominates a small model's cost.

        Raises KVCacheFull (nothing changed) when the new nodes do not fit, and
        ValueError / KeyError on malformed input (nothing changed)."""
        return self.execute(self.prepare(inputs, logits_indices, last_only=last_only))

    def prepare(
        self,
        inputs: list[SeqInput],
        logits_indices: Sequence[int] | None = None,
        *,
        last_only: bool = False,
    ) -> ForwardBatch:
        """The host half of `forward`: validate, take KV slots, append the new nodes to
        the scratch and describe the forward. A CUDA-graph runner pads the result to
        its bucket (adaserve/model/cuda_graphs.py) before `execute`."""
        self._validate(inputs, logits_indices)
        self.cache.reserve({x.seq_id: len(x.tokens) for x in inputs})
        batch, positions = self._append(inputs)
        ids = np.concatenate([np.asarray(x.tokens, dtype=np.int64) for x in inputs])
        rows = None
        if last_only:
            rows = np.cumsum(np.asarray(batch.query_lens, dtype=np.int64)) - 1
        elif logits_indices is not None:
            rows = np.asarray(logits_indices, dtype=np.int64)
        return ForwardBatch(batch, ids, positions, rows)

    @torch.inference_mode()
    def execute(self, fb: ForwardBatch) -> torch.Tensor:
        """The device half of `forward`: plan the attention once, run every layer."""
        meta = self.backend.plan(fb.attention)  # once per forward, read by every layer
        dev = self.device
        rows = None if fb.logits_rows is None else torch.from_numpy(fb.logits_rows).to(dev)
        logits = self.model(
            torch.from_numpy(fb.ids).to(dev),
            torch.from_numpy(fb.positions).to(dev),
            self.backend,
            self.cache.storage,
            meta,
            rows,
        )
        return logits.float()

    @torch.inference_mode()
    def forward_features(
        self,
        inputs: list[SeqInput],
        feature_layers: Sequence[int],
        logits_indices: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the hidden states after `feature_layers` for every new node
        ([sum k, len * hidden], model dtype; None when no layer is asked): what an EAGLE
        drafter reads (LlamaModel.forward_features). Not folded into `execute`: a
        CUDA-graph drafter wraps `self.model`'s __call__ (cuda_graphs.GraphedDraftModel),
        which only the plain path may go through."""
        fb = self.prepare(inputs, logits_indices)
        meta = self.backend.plan(fb.attention)
        dev = self.device
        rows = None if fb.logits_rows is None else torch.from_numpy(fb.logits_rows).to(dev)
        logits, feats = self.model.forward_features(
            torch.from_numpy(fb.ids).to(dev),
            torch.from_numpy(fb.positions).to(dev),
            self.backend,
            self.cache.storage,
            meta,
            rows,
            feature_layers,
        )
        return logits.float(), feats

    def _append(self, inputs: list[SeqInput]) -> tuple[AttentionBatch, np.ndarray]:
        """Add the new nodes to each sequence's scratch (blocks already reserved) and
        describe what they attend to. Returns the batch and positions int64 [T]."""
        bs = self.cache.block_size
        positions, slot_mapping, kv_slots, visible, tables = [], [], [], [], []
        for x in inputs:
            seq = self.cache.get(x.seq_id)
            k, before = len(x.tokens), seq.total_len
            depths = seq.append_scratch(np.asarray(x.parents, dtype=np.int64), x.tokens)
            positions.append(seq.committed + depths)
            slot_mapping.append(seq.slots(before, seq.total_len, bs))
            kv_slots.append(seq.slots(0, seq.total_len, bs))
            # The whole committed prefix, plus the node's scratch ancestors and itself.
            vis = np.ones((k, seq.total_len), dtype=bool)
            vis[:, seq.committed :] = seq.ancestors[-k:]
            visible.append(vis)
            tables.append(list(seq.block_table))
        batch = AttentionBatch(
            query_lens=[len(x.tokens) for x in inputs],
            slot_mapping=np.concatenate(slot_mapping),
            kv_slots=kv_slots,
            visible=visible,
            block_tables=tables,
            prefill=[x.prefill for x in inputs],
        )
        return batch, np.concatenate(positions)

    def _validate(self, inputs: list[SeqInput], logits_indices: Sequence[int] | None) -> None:
        if not inputs:
            raise ValueError("forward: empty batch")
        if logits_indices is not None:
            total = sum(len(x.tokens) for x in inputs)
            idx = np.asarray(logits_indices)
            if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= total)):
                raise ValueError(f"forward: logits_indices must be in [0, {total})")
        seen: set[str] = set()
        for x in inputs:
            if x.seq_id in seen:
                raise ValueError(f"forward: sequence {x.seq_id!r} appears twice in one batch")
            seen.add(x.seq_id)
            seq = self.cache.get(x.seq_id)
            tokens, parents = np.asarray(x.tokens), np.asarray(x.parents)
            k = tokens.shape[0]
            if tokens.ndim != 1 or parents.shape != tokens.shape or k == 0:
                raise ValueError(
                    f"forward({x.seq_id!r}): tokens and parents must be equal-length non-empty "
                    f"1-D arrays (got {tokens.shape} and {parents.shape})"
                )
            if tokens.min() < 0 or tokens.max() >= self.vocab_size:
                raise ValueError(
                    f"forward({x.seq_id!r}): token id out of range [0, {self.vocab_size})"
                )
            s0 = seq.scratch_len
            limit = s0 + np.arange(k)  # node j may hang off any earlier node
            if np.any(parents < -1) or np.any(parents >= limit):
                raise ValueError(
                    f"forward({x.seq_id!r}): parents must be -1 or an earlier scratch index "
                    f"(scratch has {s0} nodes before this call)"
                )
            max_depth = self._max_depth(seq.depths, parents)
            if seq.committed + max_depth >= self.max_model_len:
                raise ValueError(
                    f"forward({x.seq_id!r}): position {seq.committed + max_depth} exceeds "
                    f"max_model_len {self.max_model_len}"
                )

    @staticmethod
    def _max_depth(old_depths: list[int], parents: np.ndarray) -> int:
        depths = list(old_depths)
        for p in parents.tolist():
            depths.append(depths[p] + 1 if p >= 0 else 0)
        return max(depths[len(old_depths) :])
