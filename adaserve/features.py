"""One request's target features on their way to an EAGLE drafter (torch-free).

The verifier returns the features of the positions it computed (a tree's root and
accepted path, a prefill chunk's tokens); the drafter needs, for each token it takes,
the features of the position before it (adaserve/eagle_drafter.py). The engine keeps
the rows between the two: from the position before the first token the drafter does
not hold yet, to the last position the target computed. Between decoding iterations
that is one row at most beside what the drafter has not been sent yet.
"""

from __future__ import annotations

import numpy as np


class FeatureRows:
    """Rows of features by position, [lo, hi): contiguous, appended in order."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.lo = 0
        self._rows: list[np.ndarray] = []
        self._n = 0

    @property
    def hi(self) -> int:
        return self.lo + self._n

    def add(self, start: int, rows: np.ndarray) -> None:
        """The features of positions start, start + 1, ...: rows already held are
        skipped; a gap (positions the target computed without features, which the
        engine prevents) restarts the rows there, and `window` then says what lacks."""
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"features must be [k, {self.dim}], got {rows.shape}")
        if start > self.hi or start < self.lo:
            self.lo, self._rows, self._n = start, [], 0
        rows = rows[self.hi - start :]
        if rows.shape[0]:
            self._rows.append(rows)
            self._n += rows.shape[0]

    def window(self, a: int, b: int) -> np.ndarray | None:
        """The feature rows of positions a .. b - 1 (a may be -1: a zero row, nothing
        precedes position 0), or None where some are not held."""
        if b <= a:
            return np.zeros((0, self.dim), np.float16)
        head = None
        if a == -1:
            head, a = np.zeros((1, self.dim), np.float16), 0
        if b > a and (a < self.lo or b > self.hi):
            return None
        held = self._all()[a - self.lo : b - self.lo]
        return held if head is None else np.concatenate([head, held.astype(np.float16)])

    def drop_before(self, pos: int) -> None:
        """Forget the rows of positions before `pos` (the drafter holds their tokens)."""
        if pos <= self.lo:
            return
        rows = self._all()[min(pos, self.hi) - self.lo :]
        self.lo = min(pos, self.hi)
        self._rows, self._n = ([rows] if rows.shape[0] else []), rows.shape[0]

    def _all(self) -> np.ndarray:
        if len(self._rows) != 1:
            joined = (
                np.concatenate(self._rows) if self._rows else np.zeros((0, self.dim), np.float16)
            )
            self._rows = [joined] if joined.shape[0] else []
            return joined
        return self._rows[0]
