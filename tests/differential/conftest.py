"""One `adaserve up --all-in-one` (the embedded pair) for the differential tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from adaserve.bench.fuzz import all_in_one


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with all_in_one(tmp_path_factory.mktemp("all-in-one")) as url:
        yield url
