"""The planner's in-flight activations per pipeline rank (`rank_in_flight`, what framework/plan/memory.py charges a
rank's layers with) against the schedule torch runs: each rank's most chunk forwards alive at once in torch's own
action table (bench/schedule_sim.py `action_table`, the real torch.distributed.pipelining class on the fake
backend). A chunk forward's activations live from its F until the backward that frees them: a full B, or the W
after a split I (torch's `stage_backward_input` retains the autograd graph for the weight pass). GPipe and 1F1B
execute their own loop, not `pipeline_order` (off by one in torch 2.13 for 1F1B): for them the executed order,
which tests/parallel/test_bubble_bench.py checks against a real 2-rank run.

The counts are exact integers, so the comparison is exact: a schedule entry whose count is only right on rank 0
(the `every_rank_in_flight` flag: LoopedBFS's last rank holds all m·v chunk forwards, 1F1B's only one) fails."""

from __future__ import annotations

import functools

import pytest

from bench.schedule_sim import (
    B,
    F,
    Table,
    W,
    action_table,
    compute_actions,
    executed_single_stage_table,
    validate_table,
)
from framework.parallel.pipeline_schedules import SCHEDULES, rank_in_flight

BUILT_IN = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@functools.cache
def _table(schedule: str, pp: int, m: int, virtual: int) -> Table:
    table = action_table(schedule, pp, m, virtual)
    if validate_table(table, pp * SCHEDULES[schedule].stages_per_rank(virtual), m):
        table = executed_single_stage_table(schedule, pp, m)
    return table


def torch_peaks(schedule: str, pp: int, m: int, virtual: int) -> list[int]:
    """Per rank, the most (stage, micro-batch) forwards whose activations torch's table holds at once."""
    peaks = []
    for rank in range(pp):
        alive: set[tuple[int, int]] = set()
        peak = 0
        for a in compute_actions(_table(schedule, pp, m, virtual), rank):
            key = (a.stage_index, a.microbatch_index)
            if a.computation_type == F:
                alive.add(key)
                peak = max(peak, len(alive))
            elif a.computation_type in (B, W):
                alive.discard(key)
        peaks.append(peak)
    return peaks


def planner_peaks(schedule: str, pp: int, m: int, virtual: int) -> list[float]:
    """`rank_in_flight` is in micro-batches of the rank's layers; a rank holds `stages_per_rank` chunks of them."""
    chunks = SCHEDULES[schedule].stages_per_rank(virtual)
    return [rank_in_flight(schedule, pp, m, chunks, r) * chunks for r in range(pp)]


@pytest.mark.parametrize("schedule", BUILT_IN)
def test_every_rank_holds_what_torch_holds(schedule: str) -> None:
    spec = SCHEDULES[schedule]
    cases = [(pp, m, 2) for pp in (2, 3, 4) for m in range(spec.min_micro_batches(pp), 3 * pp + 1)]
    if spec.shape == "looped":
        cases += [(2, 4, 3), (4, 8, 3)]
    checked = 0
    for pp, m, virtual in cases:
        if spec.whole_rounds and m % max(1, m // pp):
            continue  # torch refuses it (tests/parallel/test_schedule_table_vs_torch.py)
        got = torch_peaks(schedule, pp, m, virtual)
        assert planner_peaks(schedule, pp, m, virtual) == got, (schedule, pp, m, virtual, got)
        checked += 1
    assert checked >= 4


def test_the_ranks_differ_where_the_flag_matters() -> None:
    # Negative control: the reference tells the ranks apart (1F1B's p - r) and tells the schedules apart (LoopedBFS
    # and ZB-V hold as much on the last rank as on the first), so a flag read the wrong way cannot pass.
    assert torch_peaks("1F1B", 4, 8, 2) == [4, 3, 2, 1]
    assert torch_peaks("LoopedBFS", 4, 8, 2) == [16, 16, 16, 16]
    assert torch_peaks("ZBVZeroBubble", 4, 4, 2) == [5, 6, 7, 8]
