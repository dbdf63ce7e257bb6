"""One torch thread per test process: the CI machine has 2 cores shared by everything else running."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> Iterator[None]:
    yield
