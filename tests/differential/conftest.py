"""One `adaserve up --all-in-one` (the embedded pair) for the differential tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from adaserve.bench.fuzz import all_in_one


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # 40 KV blocks of 16 tokens: few enough that concurrent fuzz cases can preempt each
    # other (n and best_of multiply a case), so the
    # recompute path (and the prefix cache it reads) is compared too.
    with all_in_one(tmp_path_factory.mktemp("all-in-one"), kv_blocks=40) as url:
        yield url
