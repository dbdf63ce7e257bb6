"""Adding a pipeline schedule is one entry in one table (framework/parallel/pipeline_schedules.py): a schedule
registered there is accepted by config validation, the mesh and micro-batch checks, the planner and the schedule
simulator, with no other edit. Pure: no processes (the simulator builds torch's schedule on the fake backend)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.schedule_sim import (
    action_table,
    executed_single_stage_table,
    per_rank_costs,
    simulate,
    stages_per_rank,
)
from framework.base.errors import ConfigError
from framework.config import load_config
from framework.parallel.mesh import ParallelDims
from framework.parallel.pipeline_schedules import (
    SCHEDULES,
    PipelineSchedule,
    bubble_fraction,
    register_schedule,
    schedule_micro_batch_problem,
    stages_of_rank,
    unregister_schedule,
)
from framework.plan.hardware import get_hardware
from framework.plan.layout import Workload
from framework.plan.search import SearchSpace, plan
from framework.testing.tiny import TINY
from framework.train.parallel_engine import micro_batches
from models.config import model_config

NAME = "TestFillDrain"


@pytest.fixture
def dummy() -> Iterator[PipelineSchedule]:
    """A new single-stage schedule run by torch's GPipe class, whose minimum is 2 micro-batches per rank."""
    spec = register_schedule(PipelineSchedule(
        name=NAME, torch_class="GPipe", shape="single", bubble=lambda p, m, v: (p - 1) / (m + p - 1),
        in_flight=lambda p, m, v, rank: m / p, min_micro_per_rank=2, forwards_first=True, every_rank_in_flight=True))
    yield spec
    unregister_schedule(NAME)
    assert NAME not in SCHEDULES


def test_a_registered_schedule_is_accepted_everywhere(dummy: PipelineSchedule) -> None:
    # config validation
    cfg = load_config(TINY, ["parallel.pp=2", f"parallel.pp_schedule={NAME}", "parallel.dp_shard=1"])
    assert cfg.parallel.virtual_stages == 1
    with pytest.raises(ConfigError, match="needs a multi-stage schedule"):
        load_config(TINY, ["parallel.pp=2", f"parallel.pp_schedule={NAME}", "parallel.pp_virtual_stages=2"])
    # mesh and micro-batch checks (what `launch local` runs before any process starts)
    dims = ParallelDims.from_config(cfg.parallel, 2, cfg.model)
    assert stages_of_rank(1, 2, 1, NAME) == [1]
    assert micro_batches(dims, cfg.train, NAME) >= 4
    assert "needs at least 2 x parallel.pp" in schedule_micro_batch_problem(NAME, 2, 3)
    # the planner enumerates it and prices its bubble with the table's formula
    work = Workload(model_config("llama3-8b", max_seq_len=4096), 4096, 512)
    result = plan(work, 64, get_hardware("h100-80g"), SearchSpace(schedules=(NAME,)))
    piped = [e for e in result.feasible if e.layout.pp > 1]
    assert piped and all(e.layout.schedule == NAME for e in piped)
    e = piped[0]
    assert e.bubble == bubble_fraction(NAME, e.layout.pp, e.layout.n_micro(512), e.layout.virtual)
    # the simulator: torch's own table for the class, and the executed order, give the closed-form bubble
    assert stages_per_rank(NAME) == 1
    assert len(action_table(NAME, 2, 4)) == 2
    idle = simulate(executed_single_stage_table(NAME, 2, 4), 2, per_rank_costs(1.0, 1.0, 1.0, NAME)).idle_fraction()
    assert idle == pytest.approx(bubble_fraction(NAME, 2, 4), abs=1e-12)


def test_an_unknown_schedule_is_refused_with_the_table_names() -> None:
    with pytest.raises(ConfigError, match="did you mean 1F1B") as err:
        load_config(TINY, ["parallel.pp=2", "parallel.pp_schedule=1f1b_"])
    assert all(name in str(err.value) for name in SCHEDULES)
    assert NAME not in SCHEDULES
