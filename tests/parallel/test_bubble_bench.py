"""The core of bench/pipeline_bubble.py without processes: torch's own schedule tables (built on the fake backend)
simulated with known costs must reproduce the closed-form bubbles where those are exact."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from bench.schedule_sim import (
    StageCosts,
    Table,
    action_table,
    executed_single_stage_table,
    fit_overhead,
    per_rank_costs,
    simulate,
    stages_per_rank,
    validate_table,
)
from framework.base.errors import ParallelismError
from framework.parallel.pipeline_schedules import bubble_fraction
from framework.testing import run_distributed

F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD


@functools.cache
def _table(schedule: str, pp: int, m: int) -> Table:
    """The table the bench runs: torch's pipeline_order, or for GPipe/1F1B the loop they execute if it differs."""
    table = action_table(schedule, pp, m)
    v = stages_per_rank(schedule)
    if validate_table(table, pp * v, m):
        table = executed_single_stage_table(schedule, pp, m)
    assert validate_table(table, pp * v, m) == []
    return table


def _idle(schedule: str, pp: int, m: int, f: float, i: float, w: float) -> float:
    v = stages_per_rank(schedule)
    return simulate(_table(schedule, pp, m), pp * v, per_rank_costs(f, i, w, schedule)).idle_fraction()


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_gpipe_and_1f1b_tables_give_the_closed_form_bubble(schedule: str) -> None:
    # (p-1)/(m+p-1) is exact for uniform stages whatever B/F is: check F = B and B = 2F (Narayanan et al. 2021).
    for pp, m in [(2, 4), (4, 8), (8, 16)]:
        want = (pp - 1) / (m + pp - 1)
        assert bubble_fraction(schedule, pp, m) == pytest.approx(want)
        assert _idle(schedule, pp, m, 1.0, 0.5, 0.5) == pytest.approx(want, abs=1e-12)  # F = B
        assert _idle(schedule, pp, m, 1.0, 1.0, 1.0) == pytest.approx(want, abs=1e-12)  # B = 2F


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                      "DualPipeV"])
def test_multi_stage_tables_match_the_planner_formula_with_equal_f_i_w(schedule: str) -> None:
    # The planner's rows assume T_F = T_B(input) = T_W and m >= 2p; there they are exact for torch's tables.
    for pp in (2, 4):
        m = 2 * pp
        got = _idle(schedule, pp, m, 1.0, 1.0, 1.0)
        assert got == pytest.approx(bubble_fraction(schedule, pp, m, stages_per_rank(schedule)), abs=1e-12)
        assert got < bubble_fraction("1F1B", pp, m)  # more stages per rank or split backward: a smaller bubble


def test_few_micro_batches_leave_a_larger_bubble_than_the_formula() -> None:
    # ZB-V needs m >= 2p - 1 to fill the V; with m = p its table idles more than the formula promises.
    assert _idle("ZBVZeroBubble", 4, 4, 1.0, 1.0, 1.0) > bubble_fraction("ZBVZeroBubble", 4, 4, 2) + 0.05


def test_hand_built_gpipe_timeline_and_costs() -> None:
    # 2 stages, 3 micro-batches, F = 1, B = 2: makespan (m + p - 1)(F + B) = 12, each rank busy 9.
    table: dict[int, list[_Action | None]] = {
        s: [_Action(s, F, k) for k in range(3)] + [_Action(s, B, k) for k in range(3)] for s in range(2)}
    tl = simulate(table, 2, StageCosts(1.0, 1.0, 1.0))
    assert tl.makespan == 12.0 and tl.busy == {0: 9.0, 1: 9.0}
    assert tl.idle_fraction() == pytest.approx(0.25)
    assert simulate(table, 2, StageCosts(1.0, 1.0, 1.0), hop=0.5).makespan == 13.0  # 2 hops on the path
    o = fit_overhead(table, 2, StageCosts(1.0, 1.0, 1.0), simulate(table, 2, StageCosts(1.0, 1.0, 1.0),
                                                                   overhead=0.3).makespan)
    assert o == pytest.approx(0.3, abs=1e-6)


def test_torch_stage0_split_moves_the_input_grad_into_w() -> None:
    table: dict[int, list[_Action | None]] = {0: [_Action(0, F, 0), _Action(0, _ComputationType.BACKWARD_INPUT, 0),
                                                  _Action(0, _ComputationType.BACKWARD_WEIGHT, 0)]}
    spans = simulate(table, 1, StageCosts(1.0, 2.0, 3.0)).spans[0]
    assert [end - start for _, start, end in spans] == [1.0, 0.0, 5.0]
    spans = simulate(table, 1, StageCosts(1.0, 2.0, 3.0), torch_stage0=False).spans[0]
    assert [end - start for _, start, end in spans] == [1.0, 2.0, 3.0]


def test_bad_tables_and_refused_layouts_raise() -> None:
    backwards_first: dict[int, list[_Action | None]] = {0: [_Action(0, B, 0), _Action(0, F, 0)],
                                                        1: [_Action(1, F, 0), _Action(1, B, 0)]}
    with pytest.raises(ParallelismError, match="deadlocks"):
        simulate(backwards_first, 2, StageCosts(1.0, 1.0, 1.0))
    assert validate_table({0: [_Action(0, F, 1)]}, 1, 1)  # wrong micro-batch: reported
    with pytest.raises(ParallelismError, match="DualPipeV"):
        action_table("DualPipeV", 4, 4)  # needs m >= 2p
    with pytest.raises(ParallelismError, match="unknown"):
        action_table("Chimera", 2, 4)


def test_bench_runs_the_real_schedules_with_the_intended_costs() -> None:
    # One tiny spawn: the bench's premise is that every table action triggers exactly its intended sleeps
    # (ZB's I only the input path, W only the weight path, stage 0's W both) in the table's order.
    path = Path(__file__).resolve().parents[2] / "bench" / "pipeline_bubble.py"
    spec = importlib.util.spec_from_file_location("pipeline_bubble_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(bench)
    cases, refused = bench.plan_cases(["1F1B", "ZBVZeroBubble"], [2], [4], 2)
    assert [c.schedule for c in cases] == ["1F1B", "ZBVZeroBubble"] and refused == []
    results = run_distributed(bench._rank_main, 2, backend="gloo", timeout_s=120, cases=cases, unit_s=0.003,
                              steps=1)
    rows = bench.summarize(cases, results, 3.0)
    for row in rows:
        assert row["order_ok"], row
        assert 0.0 <= row["measured"] < 1.0 and row["table"] == pytest.approx(row["formula"])
