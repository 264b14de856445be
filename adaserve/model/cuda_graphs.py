"""CUDA graphs, in one place: bucket picking and padding, the runner that captures and
replays, and the two users of it.

- `GraphRunner` captures a step once per key (a shape bucket), largest first, into one
  memory pool (smaller graphs reuse the largest one's blocks), and replays it. The
  caller owns the static buffers the step reads and writes: it fills them, then
  replays. Nothing else in the tree calls `torch.cuda.graph`.
- `GraphedDraftModel` / `install_draft_graphs`: the drafter's beam steps 2..d on the
  Triton attention backend (`benchmarks/gpu/`; the served drafter does not install
  them yet).
- `adaserve/distill/generate.py` runs its fixed-shape decode step through a
  `GraphRunner` with one key.
- The verifier's shapes: `verify_capture_keys` (batch bucket x token bucket),
  `pick_verify_bucket` (None for an iteration carrying a prompt chunk: eager) and
  `pad_forward_batch` (dummy sequences on the pad slot). The served verifier does not
  replay graphs yet: that needs fixed-shape attention metadata (as the Triton draft
  steps have) and a GPU to check it on.

A draft step after the first has a fixed shape per (n, w): n requests, w frontier
tokens each, request-major. n varies every iteration, so graphs are captured for a few
n buckets (per w) and a step pads its inputs up to the smallest bucket >= n. Padded
rows are dummies whose outputs are dropped; the step must keep rows independent (each
padded request attends only to its own dummy slot), which is what makes padding
invisible to the real rows. Everything except capture/replay is device-independent.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from adaserve.model.attention import AttentionBatch
from adaserve.model.attention_triton import TritonBackend, TritonMetadata, pick_block_m
from adaserve.model.runner import ForwardBatch

DEFAULT_N_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

K = TypeVar("K")  # a graph's key: its shape bucket
T = TypeVar("T")  # what the step returns (static output buffers)


def pick_bucket(n: int, buckets: Sequence[int] = DEFAULT_N_BUCKETS) -> int | None:
    """The smallest bucket >= n, or None when n is above the largest (run eager)."""
    if n < 1:
        raise ValueError(f"pick_bucket: n must be >= 1, got {n}")
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


# ---- the runner ------------------------------------------------------------------------


class GraphRunner(Generic[K, T]):
    """Captures `step(key)` as one CUDA graph per key and replays it.

    `capture` takes the keys largest first: every graph goes into one memory pool, and
    the smaller ones then reuse the largest one's blocks. `step` must read and write
    only buffers that stay put (the caller's static inputs, the returned outputs);
    `replay(key)` reruns the captured kernels on whatever those inputs hold now and
    returns the same output tensors, which the next replay overwrites."""

    def __init__(self) -> None:
        self._graphs: dict[K, tuple[torch.cuda.CUDAGraph, T]] = {}
        self._pool: Any = None

    def capture(
        self, keys_largest_first: Iterable[K], step: Callable[[K], T], warmup: int = 1
    ) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for key in keys_largest_first:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compile kernels, warm the allocator off-graph
                for _ in range(warmup):
                    step(key)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = step(key)
            self._graphs[key] = (graph, out)

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def __iter__(self) -> Iterator[K]:
        return iter(self._graphs)

    def replay(self, key: K) -> T:
        graph, out = self._graphs[key]
        graph.replay()
        return out


# ---- any step over a dict of tensors ----------------------------------------------------

# ---- padded rows' KV slot ------------------------------------------------------------------

PAD_SEQ = "__cuda_graph_pad__"


def reserve_pad_slot(cache: Any) -> int:
    """The KV slot every padded row writes to and reads: the first slot of a cache
    sequence no request uses, at offset 0 of its block (so paged backends can name it
    by block). No real row's attention ever reads it."""
    if PAD_SEQ not in cache.seqs:
        cache.add(PAD_SEQ)
        cache.reserve({PAD_SEQ: 1})
    slot = int(cache.get(PAD_SEQ).slots(0, 1, cache.block_size)[0])
    assert slot % cache.block_size == 0
    return slot


# ---- the verifier: graphs for tree iterations, eager for prefill ---------------------------
#
# vLLM's FULL / PIECEWISE split, in our terms: an iteration whose every sequence sends a
# token tree (decode-shaped: few tokens per sequence, short attention rows) is padded
# to a (batch bucket, token bucket) and can replay a graph captured for that shape; an
# iteration carrying a prompt chunk (long, dense attention, few of them) runs eagerly,
# where launch overhead is small next to its work. Padding appends dummy sequences:
# each has at least one token, writes and reads only the pad slot, and comes after every
# real sequence, so the real rows' packed order, logits and KV are those of the
# unpadded forward. Everything here is host-side and device-free (tested on CPU by
# running the padded batch eagerly: tests/test_verify_graph_buckets.py).

DEFAULT_VERIFY_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_VERIFY_TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, order=True)
class VerifyBucket:
    """One captured verifier shape."""

    tokens: int  # packed tokens per forward, real and dummy (first: order sorts by it)
    batch: int  # sequences per forward, real and dummy


def verify_capture_keys(
    batch_buckets: Sequence[int] = DEFAULT_VERIFY_BATCH_BUCKETS,
    token_buckets: Sequence[int] = DEFAULT_VERIFY_TOKEN_BUCKETS,
    max_batch_tokens: int | None = None,
) -> list[VerifyBucket]:
    """Every shape to capture, largest first (one memory pool: the smaller graphs reuse
    the largest one's blocks). A shape needs at least one token per sequence; shapes
    above `max_batch_tokens` (engine.max_batch_tokens) never occur."""
    keys = [
        VerifyBucket(tokens=t, batch=b)
        for b in batch_buckets
        for t in token_buckets
        if t >= b and (max_batch_tokens is None or t <= max_batch_tokens)
    ]
    return sorted(keys, reverse=True)


def pick_verify_bucket(
    query_lens: Sequence[int],
    prefill: Sequence[bool],
    batch_buckets: Sequence[int] = DEFAULT_VERIFY_BATCH_BUCKETS,
    token_buckets: Sequence[int] = DEFAULT_VERIFY_TOKEN_BUCKETS,
) -> VerifyBucket | None:
    """The smallest captured shape this forward pads to, or None: run it eagerly (a
    prompt chunk rides in it, or it is larger than every bucket)."""
    if any(prefill):
        return None  # PIECEWISE in vLLM's terms: prefill iterations run eagerly
    n, t = len(query_lens), int(sum(query_lens))
    for nb in batch_buckets:
        if nb < n:
            continue
        tb = pick_bucket(t + (nb - n), token_buckets)  # each dummy holds >= 1 token
        if tb is None:
            return None
        if tb == t or nb > n:  # padding tokens need a dummy sequence to hold them
            return VerifyBucket(tokens=tb, batch=nb)
    return None


def pad_forward_batch(fb: ForwardBatch, bucket: VerifyBucket, pad_slot: int, block_size: int):
    """`fb` with dummy sequences appended up to `bucket` (see above). Real rows keep
    their packed indices; `logits_rows` None (all rows) then covers the dummies too,
    so the caller keeps the first T rows."""
    a = fb.attention
    n, t = len(a.query_lens), len(fb.ids)
    dummies, extra = bucket.batch - n, bucket.tokens - t
    if dummies < 0 or extra < dummies or (extra and not dummies):
        raise ValueError(f"pad_forward_batch: {n} sequences / {t} tokens do not fit {bucket}")
    if not dummies:
        return fb
    lens = [1] * (dummies - 1) + [extra - (dummies - 1)]
    one = np.array([pad_slot], dtype=np.int64)
    attention = AttentionBatch(
        query_lens=[*a.query_lens, *lens],
        slot_mapping=np.concatenate([a.slot_mapping, np.full(extra, pad_slot, np.int64)]),
        kv_slots=[*a.kv_slots, *([one] * dummies)],
        visible=[*a.visible, *(np.ones((k, 1), dtype=bool) for k in lens)],
        block_tables=[*a.block_tables, *([[pad_slot // block_size]] * dummies)],
        prefill=[*(a.prefill or [False] * n), *([False] * dummies)],
    )
    zeros = np.zeros(extra, dtype=np.int64)
    return dataclasses.replace(
        fb,
        attention=attention,
        ids=np.concatenate([fb.ids, zeros]),
        positions=np.concatenate([fb.positions, zeros]),
    )


# ---- the drafter's beam steps on the Triton backend ------------------------------------
#
# A beam step after the first forwards n*w frontier tokens, w per request. Its launch
# sequence depends only on (n, w) once the attention metadata lives in fixed-shape
# device buffers (the Triton kernel reads every length from memory), so a graph is
# captured per (n bucket, w) and replayed with the step's contents copied in.
#
# `GraphedDraftModel` wraps the runner's model (the runner calls `self.model(...)` with
# the metadata its backend planned), so the runner's bookkeeping (KV reservation,
# scratch trees, commit) is unchanged and the drafter code does not know graphs exist.
# A call that does not fit a captured graph (step 1 with its last-row logits, a ragged
# batch, n above the largest bucket, a longer context than the buffers) runs eagerly.
#
# Padding: requests n..bucket-1 are dummies with one query block each, a one-key
# context, and KV writes into a slot reserved for them (a cache sequence no one else
# uses), so their rows never touch a real request's KV.

DEFAULT_DRAFT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Buffers:
    """The fixed-shape inputs of one (bucket, w) draft step."""

    ids: torch.Tensor  # int64 [bucket * w]
    pos: torch.Tensor  # int64 [bucket * w]
    meta: TritonMetadata  # fixed-shape buffers


class GraphedDraftModel:
    """Drop-in for `runner.model` that replays captured graphs for uniform beam steps.
    Without graphs (CPU, `use_graphs=False`) the same padded buffers run eagerly,
    which is how the padding is checked without a GPU."""

    def __init__(
        self,
        runner: Any,
        widths: Sequence[int],
        n_buckets: Sequence[int] = DEFAULT_DRAFT_BUCKETS,
        max_depth: int = 8,
        use_graphs: bool | None = None,
    ) -> None:
        self.use_graphs = runner.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA runner")
        if not isinstance(runner.backend, TritonBackend):
            raise ValueError("CUDA-graph draft steps need attention_backend='triton'")
        self.model = runner.model
        self.runner = runner
        self.widths = tuple(sorted(set(widths)))
        self.n_buckets = tuple(n_buckets)
        self.kv_cap = int(runner.max_model_len)
        self.max_depth = max_depth
        self.group = runner.backend.group
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._graphs: GraphRunner[tuple[int, int], torch.Tensor] = GraphRunner()
        self.pad_slot = reserve_pad_slot(runner.cache)
        self.replays = 0
        self.eager_calls = 0

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped model's
        return getattr(self.__dict__["model"], name)

    # -- capture -----------------------------------------------------------------------

    def _static(self, bucket: int, width: int) -> _Buffers:
        dev = self.runner.device
        t = bucket * width
        bm = pick_block_m(width * self.group)
        per_seq = -(-width * self.group // bm)

        def i32(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=dev, dtype=torch.int32)

        meta = TritonMetadata(
            slot_mapping=torch.full((t,), self.pad_slot, dtype=torch.int64, device=dev),
            q_start=i32(torch.arange(bucket) * width),
            q_len=i32(torch.full((bucket,), width)),
            kv_len=i32(torch.ones(bucket)),
            prefix_len=i32(torch.ones(bucket)),
            slots=i32(torch.full((bucket, self.kv_cap), self.pad_slot)),
            mask=torch.zeros(bucket, width, self.max_depth * width, dtype=torch.uint8, device=dev),
            prog_seq=i32(torch.arange(bucket).repeat_interleave(per_seq)),
            prog_row=i32((torch.arange(per_seq) * bm).repeat(bucket)),
            block_m=bm,
        )
        ids = torch.zeros(t, dtype=torch.int64, device=dev)
        pos = torch.zeros(t, dtype=torch.int64, device=dev)
        return _Buffers(ids, pos, meta)

    def _padded_step(self, key: tuple[int, int]) -> torch.Tensor:
        b = self._buffers[key]
        runner = self.runner
        return self.model(b.ids, b.pos, runner.backend, runner.cache.storage, b.meta, None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Build every (bucket, w)'s buffers and, with graphs, capture them largest
        first into one memory pool."""
        keys = [(b, w) for w in sorted(self.widths, reverse=True) for b in self.n_buckets[::-1]]
        for b, w in keys:
            self._buffers[(b, w)] = self._static(b, w)
        if self.use_graphs:
            self._graphs.capture(keys, self._padded_step)

    # -- the call the runner makes -------------------------------------------------------

    def _key(self, meta: Any, rows: torch.Tensor | None) -> tuple[int, int] | None:
        if rows is not None or not isinstance(meta, TritonMetadata) or not meta.q_lens_host:
            return None
        width = meta.q_lens_host[0]
        if width not in self.widths or any(k != width for k in meta.q_lens_host):
            return None
        if meta.max_kv > self.kv_cap or meta.max_tree > self.max_depth * width:
            return None
        bucket = pick_bucket(len(meta.q_lens_host), self.n_buckets)
        key = None if bucket is None else (bucket, width)
        return key if key in self._buffers else None

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        backend: Any,
        kv: Any,
        meta: Any,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        key = self._key(meta, logits_rows)
        if key is None:  # eager: no graph fits this call
            self.eager_calls += 1
            return self.model(ids, positions, backend, kv, meta, logits_rows)
        g = self._buffers[key]
        n, t = len(meta.q_lens_host), ids.shape[0]
        s = g.meta
        # Every padded row is reset each call: a stale real slot there would let a
        # dummy token overwrite a real request's KV.
        g.ids[:t].copy_(ids)
        g.pos[:t].copy_(positions)
        g.pos[t:].zero_()
        s.slot_mapping[:t].copy_(meta.slot_mapping)
        s.slot_mapping[t:].fill_(self.pad_slot)
        s.kv_len[:n].copy_(meta.kv_len)
        s.kv_len[n:].fill_(1)
        s.prefix_len[:n].copy_(meta.prefix_len)
        s.prefix_len[n:].fill_(1)
        s.slots[:n, : meta.slots.shape[1]].copy_(meta.slots)
        s.slots[n:, 0].fill_(self.pad_slot)
        s.mask[:n, :, : meta.mask.shape[2]].copy_(meta.mask)
        self.replays += 1
        if key not in self._graphs:  # no graphs (CPU): the same padded step, eagerly
            return self.model(g.ids, g.pos, backend, kv, s, None)[:t]
        return self._graphs.replay(key)[:t].clone()  # the next replay overwrites it


def install_draft_graphs(
    runner: Any,
    widths: Sequence[int],
    n_buckets: Sequence[int] = DEFAULT_DRAFT_BUCKETS,
    max_depth: int = 8,
    use_graphs: bool | None = None,
) -> GraphedDraftModel:
    """Wrap `runner.model` and capture the graphs; returns the wrapper (its `replays`
    and `eager_calls` counters say how often each path ran)."""
    graphed = GraphedDraftModel(runner, widths, n_buckets, max_depth, use_graphs)
    graphed.capture()
    runner.model = graphed
    return graphed
