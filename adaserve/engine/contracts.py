"""What one iteration's phases hand each other, in the order they run:

    planner.form_step -> StepPlan -> drafting.speculate -> Proposals
      -> prepare.verify_batch -> VerifyBatch -> target.forward -> ForwardResult
      -> output.commit, telemetry.observe_iteration (with IterationTiming)

Each is frozen: a phase reads what the one before decided and answers with a new value,
so data flows one way through the step (the requests' own state, `state.Request`, is
what the iteration changes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from adaserve.batching import BatchPlan
from adaserve.engine.state import Request
from adaserve.target import PrefillChunk, VerifyItem
from adaserve.tree import CandidateTree


@dataclass(frozen=True)
class StepPlan:
    """What one iteration runs, decided before the drafter is asked: which decoding
    requests get a tree and how deep, and which prompts get a chunk of how many tokens."""

    decoding: list[Request]
    drafted: list[Request]  # the decoding requests to draft for
    depth: int
    width: int
    chunks: list[tuple[Request, PrefillChunk]]
    batch: BatchPlan

    @property
    def carried(self) -> list[Request]:
        """The requests the forward carries: the trees' and the chunks'."""
        return [*self.decoding, *(r for r, _ in self.chunks)]

    def without(self, gone: Callable[[Request], bool]) -> tuple[StepPlan, list[int]]:
        """The plan without the requests `gone` names, and the indices of the decoding
        requests kept (their trees are kept by the same indices)."""
        keep = [i for i, r in enumerate(self.decoding) if not gone(r)]
        plan = replace(
            self,
            decoding=[self.decoding[i] for i in keep],
            drafted=[r for r in self.drafted if not gone(r)],
            chunks=[(r, c) for r, c in self.chunks if not gone(r)],
        )
        return plan, keep


@dataclass(frozen=True)
class Proposals:
    """The drafters' answer: per decoding request of the plan, in order, its candidate
    tree (root-only where nothing drafted it) and what drafted it (`methods.SOURCES`)."""

    trees: list[CandidateTree]
    sources: list[str]


@dataclass(frozen=True)
class VerifyBatch:
    """What the forward carries: the plan left after the requests that failed or were
    preempted on the way, each decoding request's selected tree and its source, and
    the target's inputs for them."""

    plan: StepPlan
    trees: list[CandidateTree]
    sources: list[str]
    items: list[VerifyItem]
    preempted: tuple[str, ...] = ()  # ids preempted to fit the forward's KV

    @property
    def chunks(self) -> list[PrefillChunk]:
        return [c for _, c in self.plan.chunks]


@dataclass(frozen=True)
class IterationTiming:
    """Engine-clock instants of one iteration: intake began, planning began, the
    drafters answered, the batch was prepared (selection, grammar, KV fit), the forward
    returned."""

    start: float
    planned: float
    drafted: float
    prepared: float
    verified: float


@dataclass(frozen=True)
class IterationReport:
    """What an iteration did, returned by `Engine.step` to callers that drive the engine
    one step at a time (tests, benchmarks): by request id what drafted each verified
    tree, the requests preempted, and when each phase ended."""

    sources: dict[str, str]
    preempted: tuple[str, ...]
    timing: IterationTiming

    @staticmethod
    def of(batch: VerifyBatch, timing: IterationTiming) -> IterationReport:
        sources = {it.seq_id: s for it, s in zip(batch.items, batch.sources, strict=True)}
        return IterationReport(sources, batch.preempted, timing)
