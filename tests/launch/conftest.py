"""The session's real SLURM cluster (tests/launch/slurm_cluster.py): started once, torn down by PID at the end."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_installed


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """A controller and two emulated nodes; skips only when SLURM truly cannot run, and never under CI=true."""
    try:
        ensure_installed()
    except SlurmUnavailable as why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"real SLURM is required in CI but cannot run: {why}")
        pytest.skip(f"real SLURM cannot run here: {why}")
    # Not pytest's tmp_path: munged (user munge) must traverse every directory above its socket.
    root = Path(tempfile.mkdtemp(prefix="tessera-slurm-"))
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)

