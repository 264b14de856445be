"""Measuring a hardware profile for a real target/drafter pair on this machine.

Times the model runners directly (median of `reps` after a warm-up):

- verify: one target forward of T tree tokens spread over up to 8 sequences whose
  committed context sums to C (scratch dropped after each forward);
- draft step: one drafter forward of n*w single-token frontier nodes, all logits;
- prefill: one target forward of a P-token prompt, last row's logits only;
- mixed: one target forward carrying T tree tokens (over 512 tokens of context, all
  logits) beside a P-token prompt chunk (last row's logits), as the engine's unified
  iteration runs them.

The budget is the knee of the verify curve, taken as the largest measured token count
whose forward costs at most twice a single-token one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from adaserve.sim.costmodel import (
    BASELINE_BATCH,
    BASELINE_CONTEXT,
    Curve,
    HardwareProfile,
    MixedTable,
    Surface,
)

MAX_SEQS = 8


@dataclass(frozen=True)
class ProfileGrid:
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    contexts: tuple[int, ...] = (0, 512, 2048)
    draft_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_tokens: tuple[int, ...] = (16, 64, 256, 512, 1024)
    mixed_tree: tuple[int, ...] = (1, 4, 16)
    mixed_prefill: tuple[int, ...] = (16, 64, 256, 512)
    reps: int = 3


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up: first-call allocations and lazy inits are not the steady state
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


class _Seqs:
    """Up to MAX_SEQS sequences with committed context on one runner."""

    def __init__(self, runner, prefix: str, context: int, rng: np.random.Generator) -> None:
        from adaserve.model.runner import SeqInput

        self.runner = runner
        self.ids = [f"{prefix}{i}" for i in range(MAX_SEQS)]
        per = max(1, context // MAX_SEQS)
        for sid in self.ids:
            runner.add_sequence(sid)
            toks = rng.integers(0, runner.vocab_size, size=per, dtype=np.int32)
            runner.forward([SeqInput.chain(sid, toks, prefill=True)], logits_indices=[per - 1])
            runner.commit(sid, range(per))

    def forward(self, tokens: int, rng: np.random.Generator, chain: bool, all_logits: bool):
        """`tokens` new nodes over min(tokens, MAX_SEQS) sequences; scratch dropped."""
        from adaserve.model.runner import SeqInput

        k = min(tokens, MAX_SEQS)
        sizes = [tokens // k + (1 if i < tokens % k else 0) for i in range(k)]
        inputs = []
        for sid, m in zip(self.ids, sizes, strict=False):
            toks = rng.integers(0, self.runner.vocab_size, size=m, dtype=np.int32)
            parents = np.arange(-1, m - 1, dtype=np.int32) if chain else np.full(m, -1, np.int32)
            inputs.append(SeqInput(sid, toks, parents))
        if all_logits:
            self.runner.forward(inputs)
        else:
            self.runner.forward(inputs, last_only=True)
        _sync(self.runner)
        for sid in self.ids[:k]:
            self.runner.commit(sid, [])

    def free(self) -> None:
        for sid in self.ids:
            self.runner.free(sid)


def _capacity_tokens(runner) -> int:
    """Tokens the runner's free KV blocks hold (whole blocks per sequence aside)."""
    return runner.free_blocks() * runner.block_size


def _sync(runner) -> None:
    """CUDA kernels run asynchronously: a timed forward ends when the GPU is done."""
    import torch  # the simulator itself runs without torch

    if torch.device(runner.device).type == "cuda":
        torch.cuda.synchronize()


def measure_baseline_ms(runner, reps: int = 5, seed: int = 0, windows: int = 3) -> float:
    """The baseline TPOT on this runner (`slo.baseline_tpot_ms: auto`): one decoding
    step of BASELINE_BATCH sequences holding BASELINE_CONTEXT tokens, the same point
    `HardwareProfile.baseline_ms` reads off a measured profile; the fastest of `windows`
    windows, each the median of `reps` steps. Another process on the cores can only slow
    a step, so the fastest window is the best estimate of the hardware's own time
    (adaserve/calibration.py). Leaves no sequence behind."""
    rng = np.random.default_rng(seed)
    # A KV cache smaller than the measurement (engine.kv_blocks set low) measures at the
    # context it holds: the baseline reads a little fast rather than failing startup.
    per_seq = runner.free_blocks() // MAX_SEQS * runner.block_size - BASELINE_BATCH // MAX_SEQS
    context = min(BASELINE_CONTEXT, MAX_SEQS * per_seq)
    if context < MAX_SEQS:
        raise ValueError(
            "the KV cache is too small to measure slo.baseline_tpot_ms: auto "
            f"({_capacity_tokens(runner)} tokens); set slo.baseline_tpot_ms or a larger "
            "engine.kv_blocks"
        )
    seqs = _Seqs(runner, "__baseline", context, rng)
    try:
        step = lambda: seqs.forward(BASELINE_BATCH, rng, chain=True, all_logits=True)  # noqa: E731
        return min(_median_ms(step, reps) for _ in range(max(1, windows)))
    finally:
        seqs.free()


FORWARD_CURVE_TOKENS = (1, 8, 32, 128, 512)
CONTEXT_PROBE = (128, 1024)  # a chunk of 128 tokens, at a prompt's start and 1k tokens in


def measure_forward_curve(
    runner, tokens: Sequence[int] = FORWARD_CURVE_TOKENS, reps: int = 2, seed: int = 0
) -> tuple[list[float], list[float], float]:
    """The engine's latency model (`engine.latency_curve`): forward latency against the
    tokens one forward carries, a chain of N new tokens at a sequence's start with
    logits for every row up to 32 (trees) and for the last row beyond (prefill chunks
    skip the LM head); and `context_ms`, what each thousand (query, earlier token)
    pairs add, from a 128-token chunk 1k tokens into its prompt against the same chunk
    at the start. Leaves no sequence behind."""
    from adaserve.model.runner import SeqInput

    rng = np.random.default_rng(seed)
    room = min(runner.max_model_len, _capacity_tokens(runner))
    points = [t for t in tokens if t < room] or [1]

    def chunk_ms(n: int, start: int) -> float:
        def once() -> None:
            runner.add_sequence("__curve")
            try:
                if start:
                    head = rng.integers(0, runner.vocab_size, size=start, dtype=np.int32)
                    head_in = SeqInput.chain("__curve", head, prefill=True)
                    runner.forward([head_in], logits_indices=[])
                    runner.commit("__curve", range(start))
                toks = rng.integers(0, runner.vocab_size, size=n, dtype=np.int32)
                # up to 32 tokens: a tree's nodes, all logits; beyond: a chunk, its last
                prefill = n > 32
                rows = [n - 1] if prefill else list(range(n))
                _sync(runner)
                t0 = time.perf_counter()
                inp = SeqInput.chain("__curve", toks, prefill=prefill)
                runner.forward([inp], logits_indices=rows)
                _sync(runner)
                times.append((time.perf_counter() - t0) * 1000.0)
            finally:
                runner.free("__curve")

        times: list[float] = []
        for _ in range(max(1, reps) + 1):  # the first is a warm-up
            once()
        return statistics.median(times[1:])

    ms = [chunk_ms(n, 0) for n in points]
    k, s = CONTEXT_PROBE
    context_ms = 0.0
    if k + s < room:
        context_ms = max(0.0, (chunk_ms(k, s) - chunk_ms(k, 0)) / (k * s / 1000.0))
    return [float(t) for t in points], ms, context_ms


def measure_verify(runner, grid: ProfileGrid, rng, log=print) -> Surface:
    limit = runner.max_model_len - max(grid.tokens) - 1
    contexts = [c for c in grid.contexts if c // MAX_SEQS <= limit] or [0]
    rows = []
    for c in contexts:
        seqs = _Seqs(runner, f"v{c}-", c, rng)
        row = []
        for t in grid.tokens:
            ms = _median_ms(
                lambda t=t, s=seqs: s.forward(t, rng, chain=True, all_logits=True), grid.reps
            )
            row.append(ms)
            log(f"verify  tokens={t:<5} context={c:<6} {ms:8.2f} ms")
        seqs.free()
        rows.append(row)
    return Surface(tokens=list(grid.tokens), context=[float(c) for c in contexts], ms=rows)


def measure_draft(runner, grid: ProfileGrid, rng, log=print) -> Curve:
    seqs = _Seqs(runner, "d-", 64 * MAX_SEQS, rng)
    ms = []
    for t in grid.draft_tokens:
        m = _median_ms(lambda t=t: seqs.forward(t, rng, chain=False, all_logits=True), grid.reps)
        ms.append(m)
        log(f"draft   tokens={t:<5} {m:8.2f} ms")
    seqs.free()
    return Curve(tokens=list(grid.draft_tokens), ms=ms)


def measure_prefill(runner, grid: ProfileGrid, rng, log=print) -> Curve:
    from adaserve.model.runner import SeqInput

    points = [p for p in grid.prefill_tokens if p < runner.max_model_len] or [1]
    ms = []
    for p in points:

        def once(p: int = p) -> None:
            runner.add_sequence("prefill")
            toks = rng.integers(0, runner.vocab_size, size=p, dtype=np.int32)
            runner.forward([SeqInput.chain("prefill", toks, prefill=True)], logits_indices=[p - 1])
            _sync(runner)
            runner.free("prefill")

        m = _median_ms(once, grid.reps)
        ms.append(m)
        log(f"prefill tokens={p:<5} {m:8.2f} ms")
    return Curve(tokens=[float(p) for p in points], ms=ms)


def measure_mixed(runner, grid: ProfileGrid, rng, log=print) -> MixedTable:
    from adaserve.model.runner import SeqInput

    seqs = _Seqs(runner, "m-", 512, rng)
    points = [p for p in grid.mixed_prefill if p < runner.max_model_len] or [1]
    rows = []
    for t in grid.mixed_tree:
        row = []
        for p in points:

            def once(t: int = t, p: int = p) -> None:
                k = min(t, MAX_SEQS)
                sizes = [t // k + (1 if i < t % k else 0) for i in range(k)]
                inputs = [
                    SeqInput.chain(sid, rng.integers(0, runner.vocab_size, m, dtype=np.int32))
                    for sid, m in zip(seqs.ids, sizes, strict=False)
                ]
                runner.add_sequence("mixed-prompt")
                prompt = rng.integers(0, runner.vocab_size, size=p, dtype=np.int32)
                inputs.append(SeqInput.chain("mixed-prompt", prompt, prefill=True))
                runner.forward(inputs, logits_indices=[*range(t), t + p - 1])
                _sync(runner)
                for sid in seqs.ids[:k]:
                    runner.commit(sid, [])
                runner.free("mixed-prompt")

            ms = _median_ms(once, grid.reps)
            row.append(ms)
            log(f"mixed   tree={t:<5} prefill={p:<6} {ms:8.2f} ms")
        rows.append(row)
    seqs.free()
    return MixedTable(
        tree=[float(t) for t in grid.mixed_tree], prefill=[float(p) for p in points], ms=rows
    )


def knee_budget(verify: Surface) -> int:
    """Largest measured token count costing at most twice a single-token forward."""
    base = verify(verify.tokens[0], verify.context[0])
    fits = [t for t in verify.tokens if verify(t, verify.context[0]) <= 2.0 * base]
    return int(max(fits or [verify.tokens[0]]))


def measure_profile(
    target,
    drafter,
    name: str,
    grid: ProfileGrid | None = None,
    description: str = "",
    target_name: str = "",
    drafter_name: str = "",
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> HardwareProfile:
    """A profile from loaded runners (`drafter` may be None: the draft table is then
    a zero-cost placeholder and only non-speculative policies are meaningful)."""
    grid = grid or ProfileGrid()
    rng = np.random.default_rng(seed)
    verify = measure_verify(target, grid, rng, log)
    draft = (
        measure_draft(drafter, grid, rng, log)
        if drafter is not None
        else Curve(tokens=[1.0], ms=[0.0])
    )
    prefill = measure_prefill(target, grid, rng, log)
    mixed = measure_mixed(target, grid, rng, log)
    cache = getattr(target, "cache", None)
    capacity = None
    if cache is not None:
        capacity = int(cache.num_blocks * cache.block_size)
    return HardwareProfile(
        name=name,
        description=description,
        target=target_name,
        drafter=drafter_name,
        verify=verify,
        draft_step=draft,
        prefill=prefill,
        mixed=mixed,
        kv_capacity_tokens=capacity or 500_000,
        max_model_len=int(target.max_model_len),
        vocab_size=int(target.vocab_size),
        budget=knee_budget(verify),
    )


def grid_from_args(
    tokens: Sequence[int] | None,
    contexts: Sequence[int] | None,
    reps: int | None,
    max_tokens: int | None = None,
) -> ProfileGrid:
    g = ProfileGrid()
    toks = tuple(tokens) if tokens else g.tokens
    if max_tokens:
        toks = tuple(t for t in toks if t <= max_tokens) or (1,)
    return ProfileGrid(
        tokens=toks,
        contexts=tuple(contexts) if contexts else g.contexts,
        draft_tokens=tuple(t for t in g.draft_tokens if t <= max(toks)) or (1,),
        prefill_tokens=g.prefill_tokens,
        reps=reps or g.reps,
    )
