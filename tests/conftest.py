"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class StdlibBuild:
    """The stdlib corpus built once per pytest run: pass `cfg` (or `cfg` with overrides) to `prepare_data`."""

    cfg: object  # data_pipeline.config.DataConfig (kept untyped so importing conftest stays cheap)
    build_dir: Path


@pytest.fixture(scope="session")
def stdlib_build(tmp_path_factory: pytest.TempPathFactory) -> StdlibBuild:
    """Build the three-domain stdlib corpus (vocab 4096) once per session; later prepare_data calls hit the cache."""
    from data_pipeline.config import DataConfig
    from data_pipeline.read.prepare import prepare_data

    cfg = DataConfig(kind="stdlib", cache_dir=str(tmp_path_factory.mktemp("stdlib-cache")), seq_len=64,
                     vocab_size=4096)
    prepared = prepare_data(cfg)
    assert prepared.build_dir is not None
    return StdlibBuild(cfg=cfg, build_dir=Path(prepared.build_dir))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test (bitwise-reproducible CPU runs; several test processes share 2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
