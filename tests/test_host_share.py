"""benchmarks/peers/host_share.py (issue 32's host share): it reads the phases the
engine reports, and its control-plane share counts what the issue counts."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from adaserve import metrics
from benchmarks.peers.host_share import PHASES, control_share, parse


def test_parse_reads_the_engines_phase_histogram() -> None:
    before = parse(generate_latest().decode())
    for phase, seconds in zip(PHASES, (0.001, 0.004, 0.0005, 0.006), strict=True):
        metrics.iteration_seconds.labels(phase).observe(seconds)
        metrics.iteration_seconds.labels(phase).observe(seconds)
    after = parse(generate_latest().decode())
    for phase, seconds in zip(PHASES, (0.001, 0.004, 0.0005, 0.006), strict=True):
        assert after[phase] - before.get(phase, 0.0) == pytest.approx(2 * seconds)
        assert after[f"count:{phase}"] - before.get(f"count:{phase}", 0.0) == 2


def test_control_share_counts_host_select_and_the_drafter_rpc() -> None:
    aio = {"host": 0.2, "speculate": 3.0, "select": 0.3, "verify": 6.5}
    assert control_share(aio, None) == pytest.approx(0.5 / 10.0)
    # separate: the drafter RPC is the speculate time above the all-in-one's
    sep = {"host": 0.2, "speculate": 4.0, "select": 0.8, "verify": 6.5}
    assert control_share(sep, aio) == pytest.approx((0.2 + 0.8 + 1.0) / 11.5)
    # a plan that drafts less than the all-in-one's adds no negative RPC time
    assert control_share({**sep, "speculate": 2.0}, aio) == pytest.approx(1.0 / 9.5)
