"""Properties the CUDA paths rely on, checked on 2 CPU ranks over gloo in one spawn.

- The AdamW kernel is chosen after the DTensor/plain mix is known: TP without sequence parallelism (DTensor
  matrices beside plain norm weights) with train.optimizer_impl=fused trains like the 1-process engine with
  fused AdamW (fused AdamW exists on CPU, so the kernel that would crash on CUDA at the first step runs here).
"""

from __future__ import annotations

from typing import Any

import pytest
from parallel_parity import compare, run_round

from framework.testing import run_distributed

FUSED_TP_NO_SP: dict[str, Any] = {"tp": 2, "sequence_parallel": False, "loss_parallel": False, "dp_shard": 1,
                                  "zero_stage": 0, "train.optimizer_impl": "fused"}


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {"parity": [run_round(rank, world, [FUSED_TP_NO_SP])]}
    dist.barrier()
    return out


@pytest.mark.distributed
def test_gpu_paths_on_two_ranks() -> None:
    results = run_distributed(_worker, 2, timeout_s=300)
    bad = compare([[FUSED_TP_NO_SP]], [r["parity"] for r in results])
    assert not bad, "\n".join(bad)
