"""Model-state bytes predicted by the planner against a real AdamW step on CPU (1 process and FSDP2 ZeRO-3)."""

from __future__ import annotations

import pytest

from framework.plan.layout import Layout, Precision
from framework.plan.measure import trained_state_bytes
from framework.plan.memory import model_state_bytes, rank_params
from models.config import model_config
from models.flops import num_params

FP32 = Precision.named("fp32")


def _predicted(preset: str, dp: int, zero: int) -> dict[str, float]:
    cfg = model_config(preset)
    return model_state_bytes(rank_params(cfg, Layout(), 0), Layout(dp=dp, zero_stage=zero), FP32)


@pytest.mark.parametrize("preset", ["test-tiny", "smoke-3m"])
def test_one_process_states_are_exact(preset: str) -> None:
    measured = trained_state_bytes(preset)
    predicted = _predicted(preset, 1, 0)
    psi = num_params(model_config(preset))
    assert measured["params"] == predicted["params"] == 4 * psi
    assert measured["grads"] == predicted["grads"] == 4 * psi
    assert measured["optimizer"] == predicted["optimizer"] == 8 * psi  # exp_avg + exp_avg_sq in fp32


def _rank_states(rank: int, world_size: int) -> dict[str, int]:
    return trained_state_bytes("test-tiny", shard=True)


@pytest.mark.distributed
def test_fsdp_zero3_states_within_one_percent() -> None:
    from framework.testing import run_distributed

    results = run_distributed(_rank_states, world_size=2)
    predicted = _predicted("test-tiny", 2, 3)
    for kind in ("params", "grads", "optimizer"):
        assert sum(r[kind] for r in results) == pytest.approx(2 * predicted[kind])  # nothing lost or doubled
        for r in results:
            assert r[kind] == pytest.approx(predicted[kind], rel=0.01)
