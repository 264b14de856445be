"""A virtual clock: time advances only when a modelled component says it took time."""

from __future__ import annotations


class VirtualClock:
    """Callable like `time.monotonic`, so it drops into `Engine(clock=...)`."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now = float(start_s)

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        if ms < 0:
            raise ValueError(f"time cannot run backwards ({ms} ms)")
        self.now += ms / 1000.0

    def advance_to(self, t_s: float) -> None:
        """Jump forward to `t_s` (an idle unit waiting for the next arrival)."""
        self.now = max(self.now, t_s)
