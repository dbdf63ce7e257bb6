"""The planner's MoE step: expert all-to-alls on the critical path under every schedule (the engine overlaps them
with nothing; torch's DualPipeV runs each overlapped forward/backward pair one after the other), and the busiest
expert rank's surplus tokens; Mixtral-8x7B on 512 H100s against published MoE utilization."""

from __future__ import annotations

import dataclasses

import pytest

from framework.plan.estimate import estimate
from framework.plan.hardware import get_hardware
from framework.plan.layout import Layout, Workload
from framework.plan.search import SearchSpace, plan
from models.config import model_config

HW = get_hardware("h100-80g")
MIXTRAL = model_config("mixtral-8x7b")


def test_expert_all_to_all_is_never_hidden_and_the_busiest_rank_sets_the_pace() -> None:
    work = Workload(MIXTRAL, 4096, 256)
    for schedule in ("1F1B", "DualPipeV"):
        lay = Layout(tp=1, pp=4, dp=16, ep=8, zero_stage=1, micro_batch=1, schedule=schedule,
                     virtual=2 if schedule == "DualPipeV" else 1)
        est = estimate(work, lay, HW)
        assert est.time["ep"] > 0.01
        # Every part of the step is accounted once: nothing (the all-to-alls included) hides behind compute.
        assert est.step_s == pytest.approx(sum(est.time.values()), rel=1e-9), (schedule, est.time)
    lay = Layout(tp=2, pp=1, dp=32, ep=8, zero_stage=2, micro_batch=2, recompute="selective")
    even, busy = (estimate(dataclasses.replace(work, moe_imbalance=x), lay, HW) for x in (1.0, 1.5))
    # Reference from Mixtral's published shape: 2 of 8 experts per token, SwiGLU 4096 -> 14336, 32 MoE layers.
    routed = 6 * 2 * 3 * 4096 * 14336
    m = 256 // (32 * 2)
    surplus = 0.5 * m * 32 * routed * 4096 * 2 / 2 / (HW.peak_flops * HW.mm_efficiency)
    assert busy.time["compute"] - even.time["compute"] == pytest.approx(surplus, rel=1e-9)
    assert busy.comm["ep"].wire_bytes == pytest.approx(1.5 * even.comm["ep"].wire_bytes, rel=1e-9)
    dense = Layout(tp=2, pp=1, dp=32, ep=1, zero_stage=2, micro_batch=2, recompute="selective")
    assert estimate(dataclasses.replace(work, moe_imbalance=1.5), dense, HW).step_s == \
        pytest.approx(estimate(work, dense, HW).step_s)  # one rank holds every expert: the load evens out


def test_mixtral_8x7b_on_512_h100() -> None:
    """53% MFU before the busiest-rank model; published MoE runs report 20-40% (Megatron-Core's tuned ones
    more): with the default 1.25 imbalance the estimate comes down and states its assumptions; a measured
    routing imbalance of 1.5 lands in the published range."""
    from framework.plan.cli import report

    work = Workload(MIXTRAL, 4096, 1024)
    result = plan(work, 512, HW, SearchSpace(micro_batches=(1, 2, 4)))
    best = result.feasible[0]
    assert 0.40 < best.mfu < 0.48, best.layout.describe()
    assert 0.20 < estimate(dataclasses.replace(work, moe_imbalance=1.5), best.layout, HW).mfu < 0.40
    text = report(work, result, HW, SearchSpace(), 1)
    assert "MoE assumptions: expert all-to-alls on the critical path" in text and "1.25x the mean" in text
