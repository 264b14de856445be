"""What the engine sends a drafter and gets back, for every kind of drafter.

The engine drafts through this interface only: the draft model (adaserve/speculate.py),
an EAGLE head (adaserve/eagle_drafter.py), the n-gram lookup (adaserve/ngram.py), the
gRPC client of the drafter service, and the simulator's modelled drafter. No torch here:
the engine's planning and the simulator import it without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from adaserve.tree import CandidateTree


@dataclass(frozen=True)
class DraftUpdate:
    id: str
    new_tokens: np.ndarray  # int32: tokens committed since the last call (first call: all)
    total_len: int  # committed length after applying new_tokens (drift check)
    # Take the tokens into the draft KV and draft nothing (a prompt being prefilled in
    # chunks: the drafter prefills the same chunk in the same iteration).
    ingest: bool = False
    # An EAGLE drafter's input (adaserve/eagle_drafter.py): the target's features
    # [len(new_tokens), F*H] (float16 or float32), row i those of the position before
    # new_tokens[i] (zeros before position 0). None for every other drafter.
    hidden: np.ndarray | None = None


class DrafterStateLost(RuntimeError):
    """The drafter has no (or inconsistent) state for `ids`: the engine re-sends those
    requests' full token history. Raised before any request's state changes."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = list(ids)
        super().__init__(f"drafter state lost for {len(self.ids)} request(s): {self.ids[:8]}")


@dataclass(frozen=True)
class DrafterStats:
    num_sequences: int  # requests holding draft state
    kv_usage: float  # fraction of the draft KV cache in use, 0..1


class Drafter(Protocol):
    """Two optional attributes, read with getattr: `kind` ("model" unless "eagle": an
    EAGLE head reads the target's features) and `trusted` (True: its trees are
    well-formed by construction, as the in-process drafters' are, so the engine skips
    re-validating them on the hot path; a remote drafter's are checked)."""

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]: ...

    def release(self, ids: list[str]) -> None: ...
