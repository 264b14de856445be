"""Measuring a hardware profile for a real target/drafter pair on this machine.

Times the model runners directly (median of `reps` after a warm-up; the primitives and
the baseline TPOT are adaserve/timing.py's):

- verify: one target forward of T tree tokens spread over up to 8 sequences whose
  committed context sums to C (scratch dropped after each forward);
- draft step: one drafter forward of n*w single-token frontier nodes, all logits;
- prefill: one target forward of a P-token prompt, last row's logits only;
- draft prefill: one drafter forward of a P-token prompt chunk as the drafter ingests
  it beside the target's prefill (no logits, where the runner can skip them);
- mixed: one target forward carrying T tree tokens (over 512 tokens of context, all
  logits) beside a P-token prompt chunk (last row's logits), as the engine's unified
  iteration runs them.

The budget is the knee of the verify curve, taken as the largest measured token count
whose forward costs at most twice a single-token one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from adaserve.sim.costmodel import (
    Curve,
    HardwareProfile,
    MixedTable,
    Surface,
)
from adaserve.timing import MAX_SEQS, Sequences, median_ms, sync


@dataclass(frozen=True)
class ProfileGrid:
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # Up to 8k cached tokens, the random sweep's longest prompts: past the last point the
    # surface continues its last segment, and the 512-2048 one continued to 8,192 charged
    # 4 / 8 / 16 tree tokens 1.59 / 1.32 / 1.02x what they measured (the served CPU pair,
    # BENCHMARKS.md, "A small chunk's mixed forward").
    contexts: tuple[int, ...] = (0, 512, 2048, 8192)
    draft_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_tokens: tuple[int, ...] = (16, 64, 256, 512, 1024)
    mixed_tree: tuple[int, ...] = (1, 4, 16)
    mixed_prefill: tuple[int, ...] = (16, 64, 256, 512)
    reps: int = 3


def measure_verify(runner, grid: ProfileGrid, rng, log=print) -> Surface:
    limit = runner.max_model_len - max(grid.tokens) - 1
    contexts = [c for c in grid.contexts if c // MAX_SEQS <= limit] or [0]
    rows = []
    for c in contexts:
        seqs = Sequences(runner, f"v{c}-", c, rng)
        row = []
        for t in grid.tokens:
            ms = median_ms(
                lambda t=t, s=seqs: s.forward(t, rng, chain=True, all_logits=True), grid.reps
            )
            row.append(ms)
            log(f"verify  tokens={t:<5} context={c:<6} {ms:8.2f} ms")
        seqs.free()
        rows.append(row)
    return Surface(tokens=list(grid.tokens), context=[float(c) for c in contexts], ms=rows)


def measure_draft(runner, grid: ProfileGrid, rng, log=print) -> Curve:
    seqs = Sequences(runner, "d-", 64 * MAX_SEQS, rng)
    ms = []
    for t in grid.draft_tokens:
        m = median_ms(lambda t=t: seqs.forward(t, rng, chain=False, all_logits=True), grid.reps)
        ms.append(m)
        log(f"draft   tokens={t:<5} {m:8.2f} ms")
    seqs.free()
    return Curve(tokens=list(grid.draft_tokens), ms=ms)


def measure_prefill(runner, grid: ProfileGrid, rng, log=print) -> Curve:
    return _chunk_curve(runner, grid, rng, log, "prefill", last_only=True)


def measure_draft_prefill(runner, grid: ProfileGrid, rng, log=print) -> Curve:
    """The drafter's forward over a prompt chunk, as `BeamDrafter` ingests one: the
    draft-step table holds forwards of single-token frontier nodes with all their
    logits, and past its last point the simulator prices a chunk along this curve."""
    return _chunk_curve(runner, grid, rng, log, "draft prefill", last_only=False)


def _chunk_curve(runner, grid: ProfileGrid, rng, log, label: str, last_only: bool) -> Curve:
    """One forward of a fresh P-token prompt per grid point: with the last row's logits
    (the target's prefill), or as `BeamDrafter` ingests a chunk (`speculate.ingest`)."""
    from adaserve.model.runner import SeqInput
    from adaserve.speculate import ingest, last_rows_kwarg

    rows = last_rows_kwarg(runner)
    points = [p for p in grid.prefill_tokens if p < runner.max_model_len] or [1]
    ms = []
    for p in points:

        def once(p: int = p) -> None:
            runner.add_sequence("chunk")
            toks = rng.integers(0, runner.vocab_size, size=p, dtype=np.int32)
            chunk = [SeqInput.chain("chunk", toks, prefill=True)]
            if last_only:
                runner.forward(chunk, logits_indices=[p - 1])
            else:
                ingest(runner, rows, chunk)
            sync(runner)
            runner.free("chunk")

        m = median_ms(once, grid.reps)
        ms.append(m)
        log(f"{label} tokens={p:<5} {m:8.2f} ms")
    return Curve(tokens=[float(p) for p in points], ms=ms)


def measure_mixed(runner, grid: ProfileGrid, rng, log=print) -> MixedTable:
    from adaserve.model.runner import SeqInput

    seqs = Sequences(runner, "m-", 512, rng)
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
                sync(runner)
                for sid in seqs.ids[:k]:
                    runner.commit(sid, [])
                runner.free("mixed-prompt")

            ms = median_ms(once, grid.reps)
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
    draft_prefill = measure_draft_prefill(drafter, grid, rng, log) if drafter is not None else None
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
        draft_prefill=draft_prefill,
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
