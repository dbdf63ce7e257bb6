"""Pipeline schedules as action tables, and a weighted timeline that turns a table into an idle fraction.

`action_table` asks torch.distributed.pipelining itself: it builds the real schedule class through Tessera's
`build_schedule` on the fake process-group backend (no processes, no communication) and returns its
`pipeline_order` — every rank's list of compute actions (F, B, I, W, OVERLAP_F_B), the same table the runtime
lowers and executes. `simulate` then places every action on a timeline with known costs, honouring the data
dependencies between stages, and `Timeline.idle_fraction` is what a rank idles against the step's makespan.

The cost model follows what torch's runtime really executes for a zero-bubble split (stage.py,
`backward_one_chunk(full_backward=False)` / `backward_weight_one_chunk`): on global stage 0 the input-gradient
action (I) is skipped — there is no input to differentiate — and the weight action (W) runs the whole backward,
so there I costs 0 and W costs I + W. `torch_stage0=False` simulates the ideal split instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from framework.base.errors import ConfigError, ParallelismError
from framework.parallel.pipeline_schedules import SCHEDULES, schedule_spec, stages_of_rank

F, B, I, W = (_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD,  # noqa: E741 (torch's own names)
              _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT)
OVERLAP = _ComputationType.OVERLAP_F_B
Table = dict[int, list[_Action | None]]


@dataclass(frozen=True)
class StageCosts:
    """Cost of one action on one stage (any time unit); a full backward costs `i + w`."""

    f: float
    i: float
    w: float

    @property
    def b(self) -> float:
        return self.i + self.w


def stages_per_rank(schedule: str, virtual: int = 2) -> int:
    """Stages a rank holds: 1 for GPipe/1F1B, 2 for the V schedules, `virtual` for the looped ones."""
    return schedule_spec(schedule).stages_per_rank(virtual)


def action_table(schedule: str, pp: int, n_micro: int, virtual: int = 2) -> Table:
    """`pipeline_order` of the real torch schedule class for `pp` ranks (compute actions and idle slots only).

    Builds it on the fake backend in this process, so it must be called where no process group is initialized.

    Raises:
        ParallelismError: unknown schedule, a process group is already initialized, or torch refuses the
            (pp, n_micro, virtual) combination (its message is kept, e.g. DualPipeV needs n_micro >= 2 pp).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from framework.parallel.pipeline import build_schedule

    if schedule not in SCHEDULES:
        raise ParallelismError(f"pipeline schedule {schedule!r} is unknown; use one of {list(SCHEDULES)}")
    if dist.is_initialized():
        raise ParallelismError("action_table() builds the schedule on the fake backend, but a process group is "
                               "already initialized; call it before init_process_group (or in another process)")
    v = stages_per_rank(schedule, virtual)
    ids = stages_of_rank(0, pp, v, schedule)
    dist.init_process_group("fake", rank=0, world_size=pp, store=FakeStore())
    try:
        parts = [torch.nn.Linear(1, 1) for _ in ids]
        world = dist.group.WORLD
        assert world is not None
        sched = build_schedule(parts, ids, pp * v, world, torch.device("cpu"), schedule, n_micro,
                               lambda out, target: out.sum())
        order: Table | None = getattr(sched, "pipeline_order", None)
    except (ValueError, RuntimeError) as exc:
        raise ParallelismError(f"{schedule} with pp={pp}, n_micro={n_micro}, {v} stages per rank is refused by "
                               f"torch.distributed.pipelining: {exc}; pick another n_micro or schedule") from exc
    finally:
        dist.destroy_process_group()
    assert order is not None, f"{schedule} exposes no pipeline_order"
    return {r: [a for a in acts if a is None or a.is_compute_op] for r, acts in order.items()}


def compute_actions(table: Table, rank: int) -> list[_Action]:
    """Rank `rank`'s compute actions in execution order (idle slots dropped, OVERLAP_F_B expanded)."""
    out: list[_Action] = []
    for a in table[rank]:
        if a is None:
            continue
        if a.computation_type == OVERLAP:
            out.extend(a.sub_actions or ())
        else:
            out.append(a)
    return out


def validate_table(table: Table, n_stages: int, n_micro: int) -> list[str]:
    """What keeps `table` from being executable: every stage must run each micro-batch's F exactly once and its
    backward exactly once (one B, or one I and one W). Empty when the table is consistent."""
    seen: dict[tuple[int, _ComputationType], list[int]] = {}
    for r in table:
        for a in compute_actions(table, r):
            assert a.microbatch_index is not None
            seen.setdefault((a.stage_index, a.computation_type), []).append(a.microbatch_index)
    want = list(range(n_micro))
    problems = []
    for s in range(n_stages):
        fwd = sorted(seen.get((s, F), []))
        bwd = sorted(seen.get((s, B), []) + seen.get((s, I), []))
        wgt = sorted(seen.get((s, B), []) + seen.get((s, W), []))
        for name, got in (("F", fwd), ("B/I", bwd), ("B/W", wgt)):
            if got != want:
                problems.append(f"stage {s} {name} micro-batches {got} != {want}")
    return problems


def executed_single_stage_table(schedule: str, pp: int, n_micro: int) -> Table:
    """The order GPipe and 1F1B really execute: `PipelineScheduleSingle` subclasses run their own
    `_step_microbatches` loop, not `pipeline_order` (which, for 1F1B in torch 2.13, is off by one micro-batch on
    the forwards and so fails `validate_table`). GPipe: all forwards, then all backwards, in micro-batch order.
    1F1B: stage s runs min(m, pp - s) warm-up forwards, then alternates one backward and one forward, then the
    remaining backwards (torch's `Schedule1F1B._step_microbatches`; the bench checks it against the run)."""
    try:
        spec = schedule_spec(schedule)
    except ConfigError as exc:
        raise ParallelismError(str(exc)) from exc
    if spec.shape != "single":
        singles = [s for s, sp in SCHEDULES.items() if sp.shape == "single"]
        raise ParallelismError(f"{schedule} runs its pipeline_order; executed_single_stage_table() is only for "
                               f"{singles}")
    table: Table = {}
    for s in range(pp):
        acts: list[_Action | None] = []
        warm = n_micro if spec.forwards_first else min(n_micro, pp - s)
        acts += [_Action(s, F, k) for k in range(warm)]
        for k in range(n_micro):
            acts.append(_Action(s, B, k))
            if warm + k < n_micro and not spec.forwards_first:
                acts.append(_Action(s, F, warm + k))
        table[s] = acts
    return table


@dataclass
class Timeline:
    """Per-rank busy time and the step's makespan; `spans[rank]` lists (action, start, end)."""

    busy: dict[int, float]
    makespan: float
    spans: dict[int, list[tuple[_Action, float, float]]]

    def idle_fraction(self) -> float:
        """Mean over ranks of 1 - busy / makespan."""
        if self.makespan <= 0:
            return 0.0
        return sum(1 - b / self.makespan for b in self.busy.values()) / len(self.busy)


def _deps(a: _Action, n_stages: int) -> list[tuple[int, tuple[_ComputationType, ...], int]]:
    """(stage, any of these action types, micro-batch) that must finish before `a` may start."""
    s, mb = a.stage_index, a.microbatch_index
    assert mb is not None, f"compute action {a} has no micro-batch"
    if a.computation_type == F:
        return [(s - 1, (F,), mb)] if s > 0 else []
    if a.computation_type in (B, I):
        grad_in = [(s + 1, (B, I), mb)] if s < n_stages - 1 else []
        return [(s, (F,), mb), *grad_in]
    if a.computation_type == W:
        return [(s, (I,), mb)]
    raise AssertionError(f"not a compute action: {a}")


def simulate(table: Table, n_stages: int, costs: StageCosts | Callable[[int], StageCosts], *,
             torch_stage0: bool = True, hop: float = 0.0, overhead: float = 0.0) -> Timeline:
    """Run the table on a timeline: each rank executes its actions in order, each as soon as its inputs exist.

    Args:
        table: rank -> actions, as from `action_table`.
        n_stages: global number of stages (pp x stages per rank).
        costs: one `StageCosts` for every stage, or a function of the stage index.
        torch_stage0: cost stage 0's I as 0 and its W as I + W, as torch's runtime executes it.
        hop: latency added to a dependency that crosses ranks (0: free communication).
        overhead: runtime cost added to every compute action (counted as idle, not busy: it is not model work).

    Raises:
        ParallelismError: the table deadlocks (an action waits on one that never runs before it).
    """
    cost_of = costs if callable(costs) else (lambda _s: costs)
    queues = {r: compute_actions(table, r) for r in table}
    owner = {a.stage_index: r for r, q in queues.items() for a in q}
    done: dict[tuple[int, _ComputationType, int], float] = {}
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    spans: dict[int, list[tuple[_Action, float, float]]] = {r: [] for r in queues}
    pos = dict.fromkeys(queues, 0)
    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for r, q in queues.items():
            while pos[r] < len(q):
                a = q[pos[r]]
                ready = free[r]
                for s, kinds, mb in _deps(a, n_stages):
                    ends = [done[(s, k, mb)] for k in kinds if (s, k, mb) in done]
                    if not ends:
                        break
                    ready = max(ready, ends[0] + (hop if owner.get(s, r) != r else 0.0))
                else:
                    dur = _duration(a, cost_of(a.stage_index), torch_stage0)
                    end = ready + dur + overhead
                    assert a.microbatch_index is not None
                    done[(a.stage_index, a.computation_type, a.microbatch_index)] = end
                    spans[r].append((a, ready, end))
                    free[r], busy[r] = end, busy[r] + dur
                    pos[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = {r: str(q[pos[r]]) for r, q in queues.items() if pos[r] < len(q)}
            raise ParallelismError(f"schedule table deadlocks: next actions {stuck} wait on actions that never "
                                   f"run first; the table is not executable as ordered")
    return Timeline(busy, max(free.values(), default=0.0), spans)


def fit_overhead(table: Table, n_stages: int, costs: StageCosts, makespan: float, *,
                 torch_stage0: bool = True) -> float:
    """The per-action overhead that stretches the simulated step to `makespan` (0 if it is already longer).

    The makespan grows monotonically with the overhead, so bisection finds it; the bench uses it to express a
    measured step as "the table plus o ms of runtime per action".
    """
    def span(o: float) -> float:
        return simulate(table, n_stages, costs, torch_stage0=torch_stage0, overhead=o).makespan

    if span(0.0) >= makespan:
        return 0.0
    lo, hi = 0.0, makespan
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < makespan else (lo, mid)
    return (lo + hi) / 2


def _duration(a: _Action, c: StageCosts, torch_stage0: bool) -> float:
    kind = a.computation_type
    if kind == F:
        return c.f
    if kind == B:
        return c.b
    stage0 = torch_stage0 and a.stage_index == 0
    if kind == I:
        return 0.0 if stage0 else c.i
    return c.b if stage0 else c.w


def per_rank_costs(f: float, i: float, w: float, schedule: str, virtual: int = 2) -> StageCosts:
    """Stage costs when one rank's share of the model costs (f, i, w) per micro-batch, split over its stages."""
    v = stages_per_rank(schedule, virtual)
    return StageCosts(f / v, i / v, w / v)


def table_text(table: Table, width: int = 7) -> str:
    """The table as columns per rank (idle slots blank) for logs and docs."""
    rows = max(len(t) for t in table.values())
    ranks = sorted(table)
    lines = ["step " + "".join(f"r{r}".ljust(width) for r in ranks)]
    for k in range(rows):
        cells: Sequence[Any] = [table[r][k] if k < len(table[r]) else None for r in ranks]
        lines.append(f"{k:4d} " + "".join(("" if c is None else str(c)).ljust(width) for c in cells))
    return "\n".join(lines)


__all__ = ["StageCosts", "Table", "Timeline", "action_table", "compute_actions", "executed_single_stage_table",
           "fit_overhead", "per_rank_costs", "simulate", "stages_per_rank", "table_text", "validate_table"]
