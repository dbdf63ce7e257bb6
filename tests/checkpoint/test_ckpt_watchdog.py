"""Hang watchdog on real ranks: one rank stalls, every rank dumps its stacks and exits with the requeue code."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from framework.checkpoint import REQUEUE_EXIT_CODE
from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.runtime import FaultTolerance
from framework.testing import DistributedTestError, run_distributed


def _stall_on_rank1(rank: int, world: int, run_path: Path) -> None:
    cfg = CheckpointConfig(watchdog_timeout_s=3.0, collective_timeout_s=120.0, handle_signals=False)
    ft = FaultTolerance(cfg, run_path, torch.device("cpu"))
    with ft.running():
        for step in range(1, 1000):
            if rank == 1 and step == 4:
                stalled_in_a_long_computation()
            t = torch.ones(1)
            dist.all_reduce(t)  # rank 0 blocks here once rank 1 stalls
            ft.step_done(step)


def stalled_in_a_long_computation() -> None:
    time.sleep(3600)


@pytest.mark.distributed
def test_stalled_rank_gives_stacks_from_every_rank_and_requeue_code(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_stall_on_rank1, 2, timeout_s=90, run_path=tmp_path)
    message = str(info.value)
    assert message.count(f"exit code {REQUEUE_EXIT_CODE}") == 2, message
    assert time.monotonic() - t0 < 60
    stacks = {r: (tmp_path / "stacks" / f"rank_{r}.txt").read_text() for r in range(2)}
    assert "stalled_in_a_long_computation" in stacks[1]
    assert "_stall_on_rank1" in stacks[0] and "stalled_in_a_long_computation" not in stacks[0]
    for r, text in stacks.items():
        assert f"rank {r} pid" in text and "no step completed" in text and "last completed step 3" in text
