"""Goodness-of-fit helpers for the sampling tests (no scipy in the environment)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of observed `counts` against expected `probs`.

    Categories with expected count < 5 are pooled into one, as the test requires.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    total = counts.sum()
    expected = probs * total
    if np.any((expected == 0) & (counts > 0)):
        return 0.0  # a sample the distribution says is impossible
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.shape[0] - 1
    if df < 1:
        return 1.0
    # P(chi2_df > stat) = Q(df / 2, stat / 2), the regularized upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """For loops of tiny torch ops: on a shared, oversubscribed CPU an intra-op thread
    pool turns a microsecond softmax into milliseconds of barrier waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
