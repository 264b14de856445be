"""CUDA graphs for the drafter's beam steps 2..d on the Triton attention backend.

A beam step after the first forwards n*w frontier tokens, w per request. Its launch
sequence depends only on (n, w) once the attention metadata lives in fixed-shape
device buffers (the Triton kernel reads every length from memory), so a graph is
captured per (n bucket, w) and replayed with the step's contents copied in.

`GraphedDraftModel` wraps the runner's model (the runner calls `self.model(...)` with
the metadata its backend planned), so the runner's bookkeeping (KV reservation,
scratch trees, commit) is unchanged and the drafter code does not know graphs exist.
A call that does not fit a captured graph (step 1 with its last-row logits, a ragged
batch, n above the largest bucket, a longer context than the buffers) runs eagerly.

Padding: requests n..bucket-1 are dummies with one query block each, a one-key
context, and KV writes into a slot reserved for them (a cache sequence no one
else uses), so their rows never touch a real request's KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from adaserve.cuda_graphs import pick_bucket
from adaserve.model.attention_triton import TritonBackend, TritonMetadata, pick_block_m

PAD_SEQ = "__cuda_graph_pad__"
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: padded buffers run eagerly (CPU check)
    ids: torch.Tensor  # int64 [bucket * w]
    pos: torch.Tensor  # int64 [bucket * w]
    meta: TritonMetadata  # fixed-shape buffers
    out: torch.Tensor  # logits [bucket * w, V]


class GraphedDraftModel:
    """Drop-in for `runner.model` that replays captured graphs for uniform beam steps."""

    def __init__(
        self,
        runner: Any,
        widths: Sequence[int],
        n_buckets: Sequence[int] = DEFAULT_BUCKETS,
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
        self._graphs: dict[tuple[int, int], _Graph] = {}
        cache = runner.cache
        if PAD_SEQ not in cache.seqs:
            cache.add(PAD_SEQ)
            cache.reserve({PAD_SEQ: 1})
        self.pad_slot = int(cache.get(PAD_SEQ).slots(0, 1, cache.block_size)[0])
        self.replays = 0
        self.eager_calls = 0

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped model's
        return getattr(self.__dict__["model"], name)

    # -- capture -----------------------------------------------------------------------

    def _static(self, bucket: int, width: int) -> tuple[torch.Tensor, torch.Tensor, TritonMetadata]:
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
        return ids, pos, meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, w), largest first, into one memory pool. Without
        graphs (CPU) only the padded buffers are built: calls then run the very same
        padded step eagerly, which is how the padding is checked on CPU."""
        runner = self.runner
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for width in sorted(self.widths, reverse=True):
            for bucket in sorted(self.n_buckets, reverse=True):
                ids, pos, meta = self._static(bucket, width)
                if not self.use_graphs:
                    self._graphs[(bucket, width)] = _Graph(None, ids, pos, meta, ids)
                    continue
                args = (ids, pos, runner.backend, runner.cache.storage, meta, None)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # compile kernels, warm the allocator
                    self.model(*args)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                self._graphs[(bucket, width)] = _Graph(graph, ids, pos, meta, out)

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
        return key if key in self._graphs else None

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
        if key is None:
            self.eager_calls += 1
            return self.model(ids, positions, backend, kv, meta, logits_rows)
        g = self._graphs[key]
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
        if g.graph is None:
            out = self.model(g.ids, g.pos, backend, kv, s, None)
            return out[:t]
        g.graph.replay()
        return g.out[:t].clone()  # the next replay overwrites the static output


def install_draft_graphs(
    runner: Any,
    widths: Sequence[int],
    n_buckets: Sequence[int] = DEFAULT_BUCKETS,
    max_depth: int = 8,
    use_graphs: bool | None = None,
) -> GraphedDraftModel:
    """Wrap `runner.model` and capture the graphs; returns the wrapper (its `replays`
    and `eager_calls` counters say how often each path ran)."""
    graphed = GraphedDraftModel(runner, widths, n_buckets, max_depth, use_graphs)
    graphed.capture()
    runner.model = graphed
    return graphed
