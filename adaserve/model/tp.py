"""Tensor parallelism across processes: rank 0 drives, the other ranks follow.

Every rank holds a shard of the weights (heads, MLP columns and vocab split at load
time, see layers.py) and a replica of the KV-cache bookkeeping with its own heads'
KV. Rank 0 broadcasts each state-changing call as a typed command before running it
itself; followers run the same command, so block tables stay identical and the
collectives inside `forward` line up. Deterministic errors (bad input, KVCacheFull)
are raised on every rank at the same point, before any collective.

Two process groups: the data plane (collectives in forward; NCCL on GPU, gloo on
CPU) and a gloo control plane for commands, whose timeout is long because followers
wait on it while the server idles.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adaserve.model.build import build_runner, resolve_device, resolve_dtype
from adaserve.model.config import ModelConfig
from adaserve.model.kv_cache import KVCacheFull
from adaserve.model.layers import TPGroup
from adaserve.model.runner import ModelRunner, SeqInput

DATA_TIMEOUT = timedelta(minutes=5)  # one forward's collectives, or start-up
CONTROL_TIMEOUT = timedelta(days=30)  # followers block here between requests
READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class AddSequence:
    seq_id: str
    tokens: list[int]
    use_cache: bool = True


@dataclass(frozen=True)
class Forward:
    inputs: list[SeqInput]
    logits_indices: list[int] | None
    last_only: bool


@dataclass(frozen=True)
class Commit:
    seq_id: str
    keep: list[int]


@dataclass(frozen=True)
class Free:
    seq_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


Command = AddSequence | Forward | Commit | Free | Shutdown


def apply(runner: ModelRunner, cmd: Command) -> torch.Tensor | None:
    """Run one command on this rank's runner."""
    match cmd:
        case AddSequence(seq_id, tokens, use_cache):
            # Every rank's cache looks the prefix up alike: the same blocks are found.
            return torch.tensor(runner.add_sequence(seq_id, tokens, use_cache))
        case Forward(inputs, logits_indices, last_only):
            return runner.forward(inputs, logits_indices, last_only=last_only)
        case Commit(seq_id, keep):
            runner.commit(seq_id, keep)
        case Free(seq_id):
            runner.free(seq_id)
        case _:
            raise TypeError(f"not a runner command: {cmd!r}")
    return None


def _broadcast(cmd: Command | None, control: Any) -> Command:
    """Rank 0 sends `cmd`; the followers pass None and get rank 0's command back."""
    box = [cmd]
    dist.broadcast_object_list(box, src=0, group=control)
    got = box[0]
    if got is None:  # rank 0 always sends a command
        raise RuntimeError("tensor parallel: rank 0 broadcast no command")
    return got


class TPRunner:
    """Rank 0's handle: the ModelRunner interface, mirrored onto the follower ranks."""

    def __init__(self, local: ModelRunner, control: Any, procs: list[Any]) -> None:
        self.local = local
        self._control = control
        self._procs = procs
        self.tp = len(procs) + 1
        self.config = local.config
        self.vocab_size = local.vocab_size
        self.device = local.device
        self.dtype = local.dtype
        self.max_model_len = local.max_model_len
        self.cache = local.cache  # read-only view for capacity checks
        self.backend = local.backend  # every rank runs the same attention backend
        self.draft_to_target = local.draft_to_target

    @staticmethod
    def launch(path: Path, tp: int, device: str, dtype: str, kwargs: dict[str, Any]) -> TPRunner:
        check_divisible(ModelConfig.from_dir(path), tp)
        dev = resolve_device(device)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            dev = torch.device("cuda", 0)
            if torch.cuda.device_count() < tp:
                raise ValueError(f"tp={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed group already exists in this process")
        threads = max(1, (os.cpu_count() or 1) // tp) if dev.type == "cpu" else None
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        procs = [
            ctx.Process(
                target=_follower_main,
                args=(rank, tp, init, backend, str(path), device, dtype, kwargs, threads, ready),
                daemon=True,
                name=f"adaserve-tp{rank}",
            )
            for rank in range(1, tp)
        ]
        for p in procs:
            p.start()
        try:
            if threads:
                torch.set_num_threads(threads)
            dist.init_process_group(
                backend, init_method=init, rank=0, world_size=tp, timeout=DATA_TIMEOUT
            )
            control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
            group = TPGroup(0, tp, None)
            local = build_runner(path, dev, resolve_dtype(dtype, dev), group, **kwargs)
            _wait_ready(ready, procs)
        except BaseException:
            for p in procs:
                p.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        return TPRunner(local, control, procs)

    # -- commands (broadcast, then run here) -------------------------------------------

    def _run(self, cmd: Command) -> torch.Tensor | None:
        _broadcast(cmd, self._control)
        return apply(self.local, cmd)

    def add_sequence(self, seq_id: str, tokens: Sequence[int] = (), use_cache: bool = True) -> int:
        if self.local.has_sequence(seq_id):  # fail here, not on every rank
            raise ValueError(f"sequence {seq_id!r} already exists")
        cached = self._run(AddSequence(seq_id, [int(t) for t in tokens], use_cache))
        assert cached is not None
        return int(cached)

    def forward(
        self,
        inputs: list[SeqInput],
        logits_indices: Sequence[int] | None = None,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        idx = None if logits_indices is None else [int(i) for i in logits_indices]
        logits = self._run(Forward(list(inputs), idx, last_only))
        assert logits is not None  # apply() returns a Forward's logits
        return logits

    def forward_features(
        self,
        inputs: list[SeqInput],
        feature_layers: Sequence[int],
        logits_indices: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` plus the features of `feature_layers` (an EAGLE drafter's input):
        the followers run the plain forward (the same collectives), rank 0 keeps its
        own hidden states, which every rank holds whole after each layer's all-reduce."""
        idx = None if logits_indices is None else [int(i) for i in logits_indices]
        _broadcast(Forward(list(inputs), idx, False), self._control)
        return self.local.forward_features(list(inputs), feature_layers, idx)

    def commit(self, seq_id: str, keep: Sequence[int]) -> None:
        self._run(Commit(seq_id, [int(s) for s in keep]))

    def free(self, seq_id: str) -> None:
        self._run(Free(seq_id))

    def close(self) -> None:
        """Stop the followers and tear down the process groups."""
        if not self._procs:
            return
        _broadcast(Shutdown(), self._control)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._procs = []
        dist.destroy_process_group()

    # -- queries (rank 0's replica answers) ----------------------------------------------

    def committed_len(self, seq_id: str) -> int:
        return self.local.committed_len(seq_id)

    def scratch_len(self, seq_id: str) -> int:
        return self.local.scratch_len(seq_id)

    def has_sequence(self, seq_id: str) -> bool:
        return self.local.has_sequence(seq_id)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.local.can_allocate(num_tokens)

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    def free_blocks(self) -> int:
        return self.local.free_blocks()

    def blocks_needed(self, growth: dict[str, int]) -> int:
        return self.local.blocks_needed(growth)

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.local.prefix_cache_stats()

    def kv_usage(self) -> float:
        return self.local.kv_usage()


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Fail before starting processes: every sharded axis must split evenly."""
    group = TPGroup(0, tp)
    for n, what in (
        (cfg.num_heads, "num_attention_heads"),
        (cfg.num_kv_heads, "num_key_value_heads"),
        (cfg.intermediate_size, "intermediate_size"),
        (cfg.vocab_size, "vocab_size"),
    ):
        group.split(n, f"{cfg.source}: {what}")


def _follower_main(
    rank: int,
    world: int,
    init: str,
    backend: str,
    path: str,
    device: str,
    dtype: str,
    kwargs: dict[str, Any],
    threads: int | None,
    ready: Any,
) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if threads:
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=DATA_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    try:
        runner = build_runner(
            Path(path), dev, resolve_dtype(dtype, dev), TPGroup(rank, world, None), **kwargs
        )
    except Exception as exc:
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((rank, None))
    while True:
        cmd = _broadcast(None, control)
        if isinstance(cmd, Shutdown):
            break
        # Deterministic errors: rank 0 raised the same one to its caller.
        with contextlib.suppress(KVCacheFull, ValueError, KeyError):
            apply(runner, cmd)
    dist.destroy_process_group()


def _wait_ready(ready: Any, procs: list[Any]) -> None:
    pending = {p.name for p in procs}
    while pending:
        try:
            rank, err = ready.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(
                f"tensor-parallel followers did not start: {sorted(pending)}"
            ) from None
        if err is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} failed to load: {err}")
        pending.discard(f"adaserve-tp{rank}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
