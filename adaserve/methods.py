"""Which drafter drafts each request, each iteration (torch-free, no clock).

A request asks for a speculation method: its own `speculation.method`, else its SLO
class's `speculation`, else `speculation.default_method`.

- `none`: plain decoding.
- `model`: the draft model (in-process `BeamDrafter` or the drafter service), in the
  iterations where the engine's plan drafts for the request (the cost cap, the slack
  plan and the SLO decide, as they always have).
- `ngram`: the n-gram drafter's tree (adaserve/ngram.py) every iteration. It costs no
  forward; selection verifies only the nodes whose f pays for their verify time.
- `eagle`: an EAGLE-style head on the target's hidden states (adaserve/eagle_drafter.py)
  where the unit's drafter is one (`--drafter embedded-eagle` or an EAGLE directory):
  it takes the draft model's place, so such a unit offers `eagle` and not `model`,
  and `auto` weighs it as it weighs the model (sources "eagle", "eagle+ngram"). A unit
  without one refuses it as unavailable (`check_available`: HTTP 400).
- `auto`: per iteration, by the learned acceptance of each method, the load and the
  SLO. Where the plan does not draft for the request with the model (its draft steps
  do not pay at this load and the SLO does not need them), the request gets the
  n-gram tree if the n-gram drafter's learned acceptance pays for verifying its
  tokens at this load (`ngram_pays`: the cost cap's model with no draft cost), else
  nothing: a relaxed request on a loaded server gets no speculation. Where the plan
  drafts for it (light load, or a tight SLO: the slack plan), it gets the n-gram tree
  alone when that tree promises as many tokens per unit of time as a model tree would
  with the model's draft time added, and otherwise the union of both (`model+ngram`):
  the best the unit has.

The expected tokens of a model tree come from the learned per-level acceptance of the
model's trees (adaptive.AcceptanceEstimate); those of an n-gram tree from its own path
probabilities (1 + sum f: its matches' agreement), scaled by the n-gram drafter's
learned calibration (accepted tokens over predicted ones, `SourceStats`). Every
verification is recorded under the source that drafted its tree (`SOURCES`), which is
what the per-method metrics report.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from adaserve.request import SPECULATION_METHODS
from adaserve.tree import CandidateTree

METHODS = SPECULATION_METHODS
# What drafted one verified tree; "model+ngram" is the union of the two.
SOURCES = ("none", "model", "ngram", "model+ngram", "eagle", "eagle+ngram")
# Requests whose method may need each drafter (so it ingests their prompts).
USES_MODEL = frozenset({"auto", "model"})
USES_EAGLE = frozenset({"auto", "eagle"})
USES_NGRAM = frozenset({"auto", "ngram"})


def check_method(method: str) -> str:
    """The method, or ValueError naming the field (HTTP 400 / INVALID_ARGUMENT)."""
    if method not in METHODS:
        raise ValueError(f"speculation.method must be one of {', '.join(METHODS)}; got {method!r}")
    return method


def resolve_method(requested: str | None, class_method: str | None, default: str) -> str:
    """The request's own method, else its SLO class's, else the deployment's."""
    return check_method(requested or class_method or default)


def available_methods(has_model: bool, has_ngram: bool, has_eagle: bool = False) -> tuple[str, ...]:
    """The methods a unit with these drafters serves (auto and none always)."""
    have = {"auto": True, "none": True, "model": has_model, "ngram": has_ngram}
    have["eagle"] = has_eagle
    return tuple(m for m in METHODS if have[m])


def drafter_source(source: str, kind: str) -> str:
    """`choose_source`'s answer named after the unit's drafter: "model" -> "eagle"
    (and "model+ngram" -> "eagle+ngram") where the drafter is an EAGLE head."""
    return source.replace("model", kind) if kind != "model" else source


def uses_drafter(source: str) -> bool:
    """Whether a tree from `source` holds the drafter's (model or EAGLE) nodes."""
    return source.split("+")[0] in ("model", "eagle")


def uses_ngram(source: str) -> bool:
    """Whether a tree from `source` holds the n-gram drafter's nodes."""
    return source.split("+")[-1] == "ngram"


def check_available(method: str, available: Iterable[str]) -> None:
    available = tuple(available)
    if method not in available:
        raise ValueError(
            f"speculation.method {method!r} is not available on this unit "
            f"(available: {', '.join(available)})"
        )


def choose_source(
    method: str,
    planned: bool,
    ngram_tokens: float,
    model_tokens: float,
    draft_share: float,
    has_model: bool,
    has_ngram: bool,
    ngram_pays: bool = True,
) -> str:
    """The source of one request's tree this iteration (module doc).

    `planned`: the plan drafts for this request with the model this iteration;
    `ngram_tokens`: expected tokens of its n-gram tree, 1 + sum f (1.0: no tree);
    `model_tokens`: expected tokens of a model tree at the planned depth;
    `draft_share`: the model's draft time as a fraction of the iteration's;
    `ngram_pays`: verifying n-gram trees pays at this load (their learned acceptance)."""
    if method == "none":
        return "none"
    if method == "ngram":
        return "ngram" if has_ngram else "none"
    use_model = planned and has_model
    if method in ("model", "eagle"):  # the unit's one drafter, whichever kind it is
        return "model" if use_model else "none"
    if not has_ngram:
        return "model" if use_model else "none"
    if not use_model:
        return "ngram" if ngram_pays else "none"
    # Per unit of time: the n-gram tree alone costs the verify; with the model's tree
    # the iteration also pays its draft steps.
    if ngram_tokens * (1.0 + draft_share) >= model_tokens:
        return "ngram"
    return "model+ngram"


def expected_tokens(tree: CandidateTree | None) -> float:
    """1 + sum of f below the root: the tokens a verification of the whole tree emits
    on average, when f is the probability that its path is accepted."""
    if tree is None or len(tree) == 1:
        return 1.0
    return float(tree.path_probs().sum())


def chain_tokens(alpha: float, depth: int) -> float:
    """sum(alpha^j, j = 0..depth): tokens a depth-d chain emits on average."""
    return float(np.sum(alpha ** np.arange(max(depth, 0) + 1)))


def scale_f(tree: CandidateTree, factor: float) -> CandidateTree:
    """The tree with every f below the root multiplied by `factor` (a calibration):
    log(factor) is added to the root's children's log q, clipped at 0 so that q <= 1
    (where it clips, that subtree's f is scaled less). Children still never exceed
    their parents."""
    if len(tree) == 1 or factor == 1.0:
        return tree
    logq = tree.logprobs.astype(np.float64)
    first = tree.parents == 0
    logq[first] = np.minimum(logq[first] + math.log(factor), 0.0)
    return CandidateTree.build(tree.tokens, tree.parents, logq, validate=False)


@dataclass
class SourceStats:
    """Decayed counts of one source's verifications: what `auto` reads and the
    per-method gauges show. Evidence fades by `decay` per iteration (~100 iterations),
    so the estimates follow the workload; the calibration starts at 1 with `weight`
    pseudo-tokens."""

    decay: float = 0.99
    weight: float = 5.0
    steps: float = 0.0  # verifications
    emitted: float = 0.0  # tokens emitted (accepted + bonus)
    drafted: float = 0.0  # drafted tokens verified
    accepted: float = 0.0  # drafted tokens accepted
    predicted: float = 0.0  # sum of the verified nodes' f, before calibration

    def observe(self, emitted: int, drafted: int, accepted: int, predicted: float) -> None:
        self.steps += 1.0
        self.emitted += emitted
        self.drafted += drafted
        self.accepted += accepted
        self.predicted += predicted

    def tick(self) -> None:
        for name in ("steps", "emitted", "drafted", "accepted", "predicted"):
            setattr(self, name, getattr(self, name) * self.decay)

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps > 0 else 1.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted > 0 else 0.0

    @property
    def calibration(self) -> float:
        """Accepted tokens per predicted one (1: the path probabilities are right)."""
        return (self.accepted + self.weight) / (self.predicted + self.weight)
