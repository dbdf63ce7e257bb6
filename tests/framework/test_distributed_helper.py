"""The multi-rank test helper itself: results by rank, collected tracebacks, root cause sorted first."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from framework.testing import DistributedTestError, run_distributed


def _all_reduce(rank: int, world: int, scale: float) -> float:
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return float(t.item())


def _fail_on_rank1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("root cause on rank 1")
    dist.barrier()  # rank 0 blocks here until rank 1's failure breaks the group


def _hard_crash(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


@pytest.mark.distributed
def test_results_by_rank_and_kwargs() -> None:
    assert run_distributed(_all_reduce, 3, scale=2.0) == [12.0, 12.0, 12.0]


@pytest.mark.distributed
def test_root_cause_first() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank1, 2, timeout_s=20)
    msg = str(info.value)
    assert "root cause on rank 1" in msg
    assert "--- rank 0 (collective-side)" in msg
    assert msg.index("--- rank 1 ---") < msg.index("--- rank 0")


@pytest.mark.distributed
def test_hard_crash_reported() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hard_crash, 2, timeout_s=10)
    assert "rank 0 exit code 3" in str(info.value)
