"""CUDA graphs for draft steps 2..d: which (n bucket, w) graph a step uses, how its
inputs are padded to that bucket, and capture/replay on CUDA.

A draft step after the first has a fixed shape per (n, w): n requests, w frontier
tokens each, request-major. n varies every iteration, so graphs are captured for a few
n buckets (per w) and a step pads its inputs up to the smallest bucket >= n. Padded rows
are dummies whose outputs are dropped; the step function must keep rows independent
(each padded request attends only to its own dummy slot), which is what makes padding
invisible to the real rows. Everything except capture/replay is device-independent
and tested on CPU in eager mode.

Inputs are a dict of tensors whose leading dimension is either n (per-request rows,
e.g. sequence lengths or block tables) or n*w (per-token rows, e.g. token ids,
positions); trailing dimensions must be the same on every call of a bucket.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

import torch

DEFAULT_N_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

StepFn = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]  # -> [n*w, ...] per token


def pick_bucket(n: int, buckets: Sequence[int] = DEFAULT_N_BUCKETS) -> int | None:
    """The smallest bucket >= n, or None when n is above the largest (run eager)."""
    if n < 1:
        raise ValueError(f"pick_bucket: n must be >= 1, got {n}")
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def pad_inputs(
    inputs: Mapping[str, torch.Tensor],
    n: int,
    width: int,
    bucket: int,
    fills: Mapping[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Each input padded along dim 0 from n to `bucket` rows (per-request inputs) or
    from n*width to bucket*width rows (per-token inputs), with `fills[key]` (default 0)."""
    if bucket < n:
        raise ValueError(f"pad_inputs: bucket {bucket} is smaller than n={n}")
    fills = fills or {}
    out = {}
    for key, x in inputs.items():
        rows = x.shape[0] if x.dim() else -1
        if rows == n * width:
            target = bucket * width
        elif rows == n:
            target = bucket
        else:
            raise ValueError(
                f"pad_inputs: input {key!r} has {rows} rows; expected n={n} (per request) "
                f"or n*w={n * width} (per token)"
            )
        if target == rows:
            out[key] = x
            continue
        pad = x.new_full((target - rows, *x.shape[1:]), fills.get(key, 0))
        out[key] = torch.cat([x, pad], dim=0)
    return out


class DraftStepGraphs:
    """Runs `step_fn` through CUDA graphs captured per (n bucket, w), eager otherwise.

    `capture(make_inputs)` captures every (bucket, w) largest first into one memory
    pool (smaller graphs reuse the largest one's blocks); `__call__` copies the padded
    inputs into the graph's static buffers, replays, and returns the first n*w rows.
    """

    def __init__(
        self,
        step_fn: StepFn,
        widths: Sequence[int],
        n_buckets: Sequence[int] = DEFAULT_N_BUCKETS,
        fills: Mapping[str, float] | None = None,
        enabled: bool | None = None,
    ) -> None:
        if list(n_buckets) != sorted(set(n_buckets)) or not n_buckets or n_buckets[0] < 1:
            raise ValueError(f"n_buckets must be increasing positive integers, got {n_buckets}")
        self.step_fn = step_fn
        self.widths = tuple(widths)
        self.n_buckets = tuple(n_buckets)
        self.fills = dict(fills or {})
        self.enabled = torch.cuda.is_available() if enabled is None else enabled
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}

    def shape_for(self, n: int, width: int) -> tuple[int, int] | None:
        """The (n bucket, w) graph a step of n requests at width w replays, or None."""
        bucket = pick_bucket(n, self.n_buckets)
        return None if bucket is None or width not in self.widths else (bucket, width)

    def capture(self, make_inputs: Callable[[int, int], Mapping[str, torch.Tensor]]) -> None:
        """Capture every (bucket, w); make_inputs(bucket, w) gives valid dummy inputs."""
        if not self.enabled:
            return
        pool = torch.cuda.graph_pool_handle()
        for width in sorted(self.widths, reverse=True):
            for bucket in sorted(self.n_buckets, reverse=True):
                static = {k: v.clone() for k, v in make_inputs(bucket, width).items()}
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm up kernels/allocator off-graph
                    self.step_fn(static)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.step_fn(static)
                self._graphs[(bucket, width)] = (graph, static, out)

    def __call__(self, inputs: Mapping[str, torch.Tensor], n: int, width: int) -> torch.Tensor:
        key = self.shape_for(n, width)
        entry = self._graphs.get(key) if self.enabled and key is not None else None
        if key is None or entry is None or not _fits(entry[1], inputs, n, width, key[0]):
            return self.step_fn(inputs)  # eager: CPU, unknown shape, or n above the buckets
        graph, static, out = entry
        for k, v in pad_inputs(inputs, n, width, key[0], self.fills).items():
            static[k].copy_(v)
        graph.replay()
        return out[: n * width].clone()

    def eager_padded(self, inputs: Mapping[str, torch.Tensor], n: int, width: int) -> torch.Tensor:
        """What a replay computes, run eagerly: pad to the bucket, run, drop padding.
        The CPU tests compare this with the unpadded step."""
        key = self.shape_for(n, width)
        if key is None:
            return self.step_fn(inputs)
        return self.step_fn(pad_inputs(inputs, n, width, key[0], self.fills))[: n * width]


def _fits(static: Mapping[str, torch.Tensor], inputs, n: int, width: int, bucket: int) -> bool:
    """Same keys and trailing shapes as the captured buffers (else run eager)."""
    if static.keys() != inputs.keys():
        return False
    for k, v in inputs.items():
        s = static[k]
        if v.shape[1:] != s.shape[1:] or v.dtype != s.dtype:
            return False
        if s.shape[0] not in (bucket, bucket * width):
            return False
    return True
