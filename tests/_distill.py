"""A fake prompt set for the distillation tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def fake_prompts(work: Path) -> None:
    """prompts.json as the tokenizing stage writes it (the tiny model has no tokenizer)."""
    rng = np.random.default_rng(1)

    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, 250, n)]

    work.mkdir(parents=True)
    (work / "prompts.json").write_text(
        json.dumps(
            {
                "direct": [ids(int(rng.integers(2, 9))) for _ in range(20)],
                "writer": [
                    {"writer": ids(4), "prefix": ids(3), "suffix": ids(2)} for _ in range(4)
                ],
                "heldout": [ids(5) for _ in range(6)],
                "eos": [255],
            }
        )
    )
