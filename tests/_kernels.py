"""Which builds of adaserve's CPU kernel this machine runs, and a one-sequence forward,
shared by the kernel tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.model import cpu_gemm
from adaserve.model.cpu_gemm import KernelUnavailable
from adaserve.model.runner import SeqInput


def _available() -> str | None:
    try:
        cpu_gemm.kernel()
    except (KernelUnavailable, OSError) as exc:
        return str(exc)
    return None


WHY = _available()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"packed kernel unavailable: {WHY}")
RUNNABLE = () if WHY is not None else cpu_gemm.supported_isas()
# Every build, each skipped where this CPU does not run it.
ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(isa not in RUNNABLE, reason=f"CPU lacks {isa}"))
    for isa in cpu_gemm.ISA_FLAGS
]


def logits_of(runner, prompt: list[int]) -> torch.Tensor:
    """The logits of every position of `prompt` as one new sequence on `runner`."""
    runner.add_sequence("s")
    try:
        return runner.forward([SeqInput.chain("s", np.asarray(prompt, np.int32))]).float()
    finally:
        runner.free("s")
