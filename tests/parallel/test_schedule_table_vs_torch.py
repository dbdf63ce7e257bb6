"""Every entry of the pipeline-schedule table (framework/parallel/pipeline_schedules.py) against the schedule torch
actually runs: the action table of the real torch.distributed.pipelining class (built on the fake backend,
bench/schedule_sim.py `action_table`) says which stages each rank holds, whether the backward is split into its
input and weight halves (what makes compile refuse the schedule), whether every forward runs before the first
backward, and the fewest micro-batches torch accepts. The table is what config checks, the planner and the
compile refusal read, so a wrong flag there is a wrong decision everywhere, with no parity test to notice."""

from __future__ import annotations

import pytest

from bench.schedule_sim import B, F, I, W, action_table, compute_actions
from framework.base.errors import ParallelismError
from framework.parallel.pipeline_schedules import SCHEDULES, stages_of_rank

BUILT_IN = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
PP = 2


@pytest.mark.parametrize("name", BUILT_IN)
def test_table_entry_matches_the_torch_schedule(name: str) -> None:
    spec = SCHEDULES[name]
    m = max(4, spec.min_micro_batches(PP))
    table = action_table(name, PP, m)
    v = spec.stages_per_rank(2)
    for rank in range(PP):
        acts = compute_actions(table, rank)
        assert sorted({a.stage_index for a in acts}) == sorted(stages_of_rank(rank, PP, v, name)), (name, rank)
        kinds = {a.computation_type for a in acts}
        assert spec.split_backward == bool(kinds & {I, W}), (name, kinds)
        assert kinds & {B, I}, (name, kinds)  # control: the table holds backwards at all
        if spec.shape == "single":
            first_backward = next(i for i, a in enumerate(acts) if a.computation_type in (B, I))
            assert spec.forwards_first == all(a.computation_type == F for a in acts[:m]), name
            assert first_backward >= 1
    assert F in {a.computation_type for a in compute_actions(table, 0)}


@pytest.mark.parametrize("name", [n for n in BUILT_IN if SCHEDULES[n].min_micro_per_rank > 1])
def test_fewest_micro_batches_are_the_ones_torch_accepts(name: str) -> None:
    least = SCHEDULES[name].min_micro_batches(PP)
    action_table(name, PP, least)  # accepted
    with pytest.raises(ParallelismError, match="refused by torch"):
        action_table(name, PP, least - 1)


@pytest.mark.parametrize("name", BUILT_IN)
def test_micro_batch_problem_is_what_torch_refuses(name: str) -> None:
    """`schedule_micro_batch_problem` claims the conditions torch's constructors check: for every micro-batch
    count around the minimum, it names a problem exactly when torch refuses the schedule, and its suggested
    neighbours are counts torch accepts."""
    from framework.parallel.pipeline_schedules import schedule_micro_batch_problem

    for m in range(2, 10):
        problem = schedule_micro_batch_problem(name, PP, m)
        try:
            action_table(name, PP, m)
            refused = False
        except ParallelismError:
            refused = True
        assert bool(problem) == refused, (name, m, problem)
        if "nearest that fit are" in problem:
            lower, upper = (int(x) for x in problem.rsplit("are ", 1)[1].split(" and "))
            assert lower < m < upper and not schedule_micro_batch_problem(name, PP, upper)
            action_table(name, PP, upper)  # accepted by torch
