"""Layout refusals at their edges: qwZ refuses compile only when both are on, cp refuses MoE models only, and the
hpZ partition error lists every valid size."""

from __future__ import annotations

import pytest

from framework.base.errors import ParallelismError
from framework.config import load_config
from framework.parallel.config import ParallelConfig
from framework.parallel.mesh import ParallelDims, zeropp_compile_problem
from framework.testing.tiny import TINY


def test_qwz_refuses_compile_only_together() -> None:
    assert zeropp_compile_problem(ParallelConfig(), True) == ""
    assert zeropp_compile_problem(ParallelConfig(zero_quantized_weights=True), False) == ""
    assert "zero_quantized_weights with train.compile=true" in zeropp_compile_problem(
        ParallelConfig(zero_quantized_weights=True), True)


def _dims(*overrides: str, world: int) -> ParallelDims:
    cfg = load_config(TINY, list(overrides))
    return ParallelDims.from_config(cfg.parallel, world, cfg.model)


def test_cp_refuses_moe_models_only() -> None:
    assert _dims("parallel.cp=2", "parallel.dp_shard=1", world=2).cp == 2  # a dense model: fine
    with pytest.raises(ParallelismError, match=r"parallel.cp=2 with a mixture-of-experts model"):
        _dims("parallel.cp=2", "parallel.dp_shard=1", "model.preset=test-moe", world=2)


def test_hpz_partition_error_lists_every_valid_size() -> None:
    with pytest.raises(ParallelismError, match=r"zero_hpz_partition_size=3 must divide .* = 8 .*\(valid: \[2, 4\]\)"):
        _dims("parallel.dp_shard=8", "parallel.zero_stage=3", "parallel.zero_hpz_partition_size=3", world=8)
