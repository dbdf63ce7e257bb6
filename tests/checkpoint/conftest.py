"""Fixtures of the checkpoint tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from ckpt_procs import Ranks


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Ranks]]:
    """Start `world` rank processes of a command; any still alive at the end of the test are killed."""
    started: list[Ranks] = []

    def _launch(argv: Sequence[str], world: int = 1, name: str = "run") -> Ranks:
        r = Ranks(argv, world, tmp_path / "logs" / f"{name}{len(started)}")
        started.append(r)
        return r

    yield _launch
    for r in started:
        r.kill()
