"""The expert mesh the engine builds (a reshape of its 5-axis rank tensor) is the layout mesh.py defines."""

from __future__ import annotations

import pytest
import torch

from framework.base.errors import ParallelismError
from framework.parallel.config import ParallelConfig
from framework.parallel.expert import check_expert_parallel
from framework.parallel.mesh import ParallelDims


@pytest.mark.parametrize("pp,rep,shard,tp,ep", [(1, 1, 8, 1, 2), (2, 1, 2, 2, 2), (2, 2, 4, 2, 4), (1, 2, 4, 4, 8),
                                                 (4, 2, 8, 8, 16), (1, 1, 4, 2, 1)])
def test_reshaped_rank_tensor_is_the_ep_layout(pp: int, rep: int, shard: int, tp: int, ep: int) -> None:
    dims = ParallelDims(pp=pp, dp_replicate=rep, dp_shard=shard, cp=1, tp=tp, ep=ep)
    ranks = torch.arange(dims.world_size).view(dims.shape)
    assert ranks.reshape(pp, rep, -1, ep).tolist() == dims.ep_layout()
    edp = ranks.reshape(pp, rep, -1, ep).permute(0, 3, 1, 2).reshape(pp * ep, -1)
    assert sorted(sorted(g) for g in edp.tolist()) == dims.edp_groups()


def test_ep_not_dividing_experts_names_the_fix() -> None:
    with pytest.raises(ParallelismError, match=r"valid ep: \[1, 2, 3, 6\]"):
        check_expert_parallel(6, 4)
    from models import model_config

    with pytest.raises(ParallelismError, match=r"must divide model\.moe\.n_experts=4"):
        ParallelDims.from_config(ParallelConfig(ep=8), 8, model_config("test-moe"))
