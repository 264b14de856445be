"""The scheduler interface the engine calls, and its in-process implementation.

The scheduler is a pure function of its inputs (no clock reads, no state between
calls), so the gRPC service (services/scheduler) and LocalScheduler answer alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from adaserve.adaptive import plan_depth_width
from adaserve.config import SchedulerSettings
from adaserve.selection import RequestProgress, Selection, SelectionParams, select
from adaserve.tree import CandidateTree, TreeBatch


class Scheduler(Protocol):
    def plan(self, n: int) -> tuple[int, int]:
        """(depth, width) of the candidate trees for n active requests."""
        ...

    def select(
        self,
        requests: Sequence[RequestProgress],
        trees: Sequence[CandidateTree] | TreeBatch,
        params: SelectionParams,
    ) -> Selection:
        """The nodes to verify; raises SelectionError (a ValueError) on bad input."""
        ...


class LocalScheduler(Scheduler):
    """Selection in the calling process."""

    def __init__(self, settings: SchedulerSettings | None = None) -> None:
        self.settings = settings or SchedulerSettings()

    def plan(self, n: int) -> tuple[int, int]:
        return plan_depth_width(n, self.settings.budget, self.settings.adaptive)

    def select(
        self,
        requests: Sequence[RequestProgress],
        trees: Sequence[CandidateTree] | TreeBatch,
        params: SelectionParams,
    ) -> Selection:
        return select(requests, trees, params)


def selection_params(
    settings: SchedulerSettings,
    depth: int,
    t_spec_ms: float,
    num_requests: int = 0,
    budget: int | None = None,
) -> SelectionParams:
    """SelectionParams from the settings, for an iteration of `num_requests` trees
    predicted to take t_spec_ms: the one place that turns settings into params.
    `budget`: this iteration's tree budget where batch formation set one (prefill chunks
    riding along take part of the knee), else the settings' B.

    The prediction is inflated by `correction_factor`, as FlexFlow Serve does, so that
    an iteration slightly slower than predicted still leaves requests on their SLO. The
    budget is at least the number of requests: every root costs a slot and must fit."""
    return SelectionParams(
        budget=max(budget or settings.budget, num_requests),
        depth=depth,
        t_spec_ms=t_spec_ms * settings.correction_factor,
        policy=settings.policy,
        n_max=settings.n_max,
        order=settings.order,
    )
