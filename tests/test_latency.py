"""The forward latency model (adaserve/latency.py): what prefill chunks add to a forward."""

from __future__ import annotations

import math

from adaserve.latency import Curve, ForwardLatency


def test_a_chunk_never_makes_a_forward_faster() -> None:
    """A measured curve that dips (a launch-bound GPU's: flat with noise) must not
    predict that prefill chunks shorten a forward, even after the drift factor has
    learned a large value where the curve is flat: that predicted iterations of
    negative length, which the selection refused, failing the iteration's requests."""
    curve = Curve((1.0, 16.0, 48.0, 512.0, 1024.0), (26.0, 34.0, 25.0, 27.0, 53.0))
    latency = ForwardLatency(curve)
    assert curve(16, 32) < curve(16, 0)  # the dip: 48 tokens "cost" less than 16
    # Chunks riding on flat stretches of the curve measured far above what it models:
    # the drift factor grows large.
    for _ in range(50):
        latency.observe(48, 400, 0.0, latency.decode_ms(48) + 30.0)
    assert latency.drift > 5.0
    for tree in (1, 16, 48, 200, 512):
        for chunk in (1, 8, 32, 100, 400, 1000):
            extra = latency.prefill_ms(tree, chunk)
            assert extra >= 0.0 and math.isfinite(extra)
            assert latency.predict_ms(tree, chunk) >= latency.predict_ms(tree, 0)
    assert latency.prefill_ms(16, 32) == 0.0  # inside the dip: nothing, not less
    # Where the curve does rise, chunks still cost what it says times the drift.
    rise = curve(48, 900) - curve(48, 0)
    assert math.isclose(latency.prefill_ms(48, 900), rise * latency.drift, rel_tol=1e-9)
