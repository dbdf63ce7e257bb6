"""Measured on several CPU ranks: model states (1 process, FSDP2 ZeRO-3) and activations under TP + SP."""

from __future__ import annotations

import pytest

from bench.plan_measure import trained_state_bytes
from framework.plan.layout import Layout, Precision
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


def _two_ranks(rank: int, world_size: int) -> tuple[dict[str, int], int]:
    from bench.plan_measure import tp_layer_saved_bytes

    # One process group for both measurements: FSDP2 ZeRO-3 model states, then one block under TP2 + SP.
    states = trained_state_bytes("test-tiny", shard=True)
    return states, tp_layer_saved_bytes(rank, world_size, preset="test-tiny", seq=32, batch=2)


@pytest.mark.distributed
def test_fsdp_zero3_states_and_tp_sp_activations() -> None:
    from framework.plan.activations import tessera_layer_bytes
    from framework.testing import run_distributed

    results = run_distributed(_two_ranks, world_size=2)
    predicted = _predicted("test-tiny", 2, 3)
    for kind in ("params", "grads", "optimizer"):
        assert sum(r[0][kind] for r in results) == pytest.approx(2 * predicted[kind])  # nothing lost or doubled
        for states, _ in results:
            assert states[kind] == pytest.approx(predicted[kind], rel=0.01)
    # DTensor TP + SP keeps the all-gathered input of the column-parallel projections at full size.
    tp_sp = tessera_layer_bytes(model_config("test-tiny"), 32, 2, tp=2, sp=True, act_bytes=4)
    assert [r[1] for r in results] == [tp_sp, tp_sp]


def test_async_checkpoint_staging_term_is_what_the_stager_holds() -> None:
    """The planner's host staging bytes against a real stage of a trained 1-process engine's checkpoint state
    (weights + AdamW moments; the per-parameter step counters are the 1% slack), pinned and bucketed."""
    import torch

    from framework.checkpoint.dcp import training_state
    from framework.checkpoint.staging import HostStager
    from framework.config import load_config
    from framework.plan.layout import Workload
    from framework.plan.memory import checkpoint_staging_bytes
    from framework.testing.tiny import TINY
    from framework.train.local_engine import LocalEngine

    cfg = load_config(TINY)
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    batch = torch.randint(0, cfg.model.vocab_size, (1, 2, cfg.data.seq_len + 1))
    engine.forward_backward(batch)
    engine.optimizer_step(1e-3)
    work = Workload(cfg.model, cfg.data.seq_len, 2, FP32)
    state = training_state(engine.model_parts, engine.optimizers)
    for budget in (1 << 30, 4096):
        stager = HostStager(budget)
        stager.stage(state)
        planned = checkpoint_staging_bytes(work, Layout(), 0, pin_budget=budget)
        assert planned["host"] == pytest.approx(stager.host_bytes, rel=0.01), budget
        assert planned["pinned"] == (planned["host"] if budget > planned["host"] else budget)
