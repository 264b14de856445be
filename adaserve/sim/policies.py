"""Serving policies, every one expressed as engine settings plus (at most) a drafter shape.

All policies run through the same engine and the same selection code:

- `adaserve`, `paper`, `equal`, `global`: selection policies (`paper` is Algorithm 2
  exactly, `adaserve` adds triage and a marginal-value stop; `equal` and `global` are
  paper 001's section 6.3 ablations), adaptive depth/width (eq. 8-9), the profile's
  token budget.
- `spec-K`: vLLM-Spec(K): a fixed chain of K drafted tokens for every request, all of
  them verified (policy global with a budget no batch can exceed): no SLO awareness.
- `specinfer`: SpecInfer's static expansion <1,1,3,1,1,1,1,1> (20 drafted nodes), all
  verified: no budget awareness.
- `cb`: continuous batching without speculation (vLLM / Sarathi-Serve style decode).
- `cb-priority`: `cb`, tight-SLO requests admitted first (the engine's `priority`).

Every policy but adaserve drafts from whole prompts (`speculation.draft_context` None),
as the systems and papers they stand for do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

SPECINFER_EXPANSION = (1, 1, 3, 1, 1, 1, 1, 1)
POLICY_NAMES = (
    "adaserve",
    "paper",
    "equal",
    "global",
    "spec-K",
    "specinfer",
    "cb",
    "cb-priority",
)
SELECTION_POLICIES = ("adaserve", "paper", "equal", "global")
# The baselines' drafters read every prompt token, as vLLM's and the papers' do: the
# drafter's context window (speculation.draft_context) is adaserve's.
FULL_CONTEXT: dict[str, Any] = {"speculation": {"draft_context": None}}


@dataclass(frozen=True)
class PolicySpec:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # merged into adaserve Settings
    expansion: tuple[int, ...] | None = None  # static tree shape for the modelled drafter
    priority_by_slo: bool = False  # lower tpot_slo_ms -> admitted first

    @property
    def speculative(self) -> bool:
        return self.overrides.get("engine", {}).get("speculation", True)


def policy_spec(name: str, max_running: int, k: int | None = None) -> PolicySpec:
    """The engine configuration of a named policy. `spec-K` may be spelled `spec` + k."""
    m = re.fullmatch(r"spec-(\d+)", name)
    if name == "spec" and k is not None:
        m = re.fullmatch(r"(\d+)", str(k))
        name = f"spec-{k}"
    if m:
        depth = int(m.group(1))
        if not 1 <= depth <= 16:
            raise ValueError(f"spec-K needs 1 <= K <= 16, got {depth}")
        return _static(name, depth, 1, max_running * (depth + 1))
    if name == "adaserve":
        return PolicySpec(name, {"scheduler": {"policy": name}})
    if name in SELECTION_POLICIES:
        return PolicySpec(name, {"scheduler": {"policy": name}, **FULL_CONTEXT})
    if name == "specinfer":
        nodes = _expansion_nodes(SPECINFER_EXPANSION)
        spec = _static(
            name, len(SPECINFER_EXPANSION), max(SPECINFER_EXPANSION), max_running * (nodes + 1)
        )
        return PolicySpec(name, spec.overrides, expansion=SPECINFER_EXPANSION)
    # Continuous batching admits as vLLM does: first come, first served (by priority
    # first for cb-priority). Scheduler policy global, not the default adaserve: the
    # admission features of selection policy adaserve (the prompt hold, deferring a
    # request whose TTFT is lost) are not vLLM's, and cb inherited the deferral for a
    # day unnoticed (BENCHMARKS.md, "Random workloads").
    plain = {
        "engine": {"speculation": False, "admission_order": "arrival"},
        "scheduler": {"policy": "global"},
    }
    if name == "cb":
        return PolicySpec(name, plain)
    if name == "cb-priority":
        return PolicySpec(name, plain, priority_by_slo=True)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


def _static(name: str, depth: int, width: int, budget: int) -> PolicySpec:
    # Policy global over a budget larger than every node of every tree: all verified.
    return PolicySpec(
        name,
        {
            **FULL_CONTEXT,
            "scheduler": {
                "policy": "global",
                "budget": budget,
                "adaptive": {
                    "policy": "fixed",
                    "fixed_depth": depth,
                    "fixed_width": width,
                    "d_min": 1,
                    "d_max": depth,
                    "w_max": width,
                },
            },
        },
    )


def _expansion_nodes(expansion: tuple[int, ...]) -> int:
    """Drafted nodes of a static expansion: layer l has prod(expansion[:l]) nodes."""
    total, layer = 0, 1
    for e in expansion:
        layer *= e
        total += layer
    return total
