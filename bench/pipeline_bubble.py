"""Pipeline bubble: idle fraction of every torch.distributed.pipelining schedule, measured against the formulas.

Eight ranks on two cores cannot time real compute, so every stage costs a fixed, known time instead: a custom
autograd op sleeps `f` in forward and `i` in its backward (the input-gradient path), a second op on the stage's
weight sleeps `w` in its backward (the weight-gradient path). Sleeping needs no CPU, so the ranks' timelines are
what the schedule makes them. Costs are per rank and per micro-batch — F = I = W = `--unit-ms` (so B = I + W = 2F,
the assumption of both the 1F1B and the zero-bubble formulas) — split evenly over the rank's stages.

For each (schedule, p, m) the real schedule class runs through Tessera's `build_schedule` on gloo with forked
ranks (`run_distributed`): a warm-up step, `--steps` steps with all costs 0 (what p2p and the Python runtime cost
alone), then `--steps` timed steps. Idle fraction = 1 - busy / makespan per rank, averaged over ranks, where busy
is the summed sleep time the ops recorded and makespan spans the earliest start to the latest end (median over
steps). Next to it: `pipeline_schedules.bubble_fraction` (the planner's formula) and the schedule's own
action table simulated with the same costs (`bench.schedule_sim`). The ops also log which
(stage, micro-batch) they ran, so the executed order is checked against the table.

    python bench/pipeline_bubble.py [--pp 2 4] [--micro 4 8] [--unit-ms 30] [--steps 5] \
        [--write docs/benchmarks/pipeline_bubble.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.schedule_sim import (
    StageCosts,
    Table,
    action_table,
    compute_actions,
    executed_single_stage_table,
    fit_overhead,
    per_rank_costs,
    simulate,
    stages_per_rank,
    validate_table,
)
from bench.sections import replace_section
from framework.base.errors import ParallelismError
from framework.parallel.pipeline import build_schedule, run_schedule
from framework.parallel.pipeline_schedules import SCHEDULES, bubble_fraction, schedule_spec, stages_of_rank
from framework.testing import run_distributed

KEY = "pipeline-bubble"
HEADING = "## Pipeline bubble"
Event = tuple[str, int, int, float, float]  # (F | I | W, stage, micro-batch, start, end)


@dataclass
class Costs:
    """Seconds one stage sleeps per action; mutable so the same stages run with and without cost."""

    f: float = 0.0
    i: float = 0.0
    w: float = 0.0
    log: list[Event] = field(default_factory=list)

    def sleep(self, kind: str, stage: int, mb: int, seconds: float) -> None:
        t0 = time.perf_counter()
        if seconds > 0:
            time.sleep(seconds)
        self.log.append((kind, stage, mb, t0, time.perf_counter()))


def micro_batch_index(x: torch.Tensor) -> int:
    """The micro-batch index column 0 carries; -1 for the uninitialized tensor torch's shape inference feeds a
    later stage on the first step (it may hold NaN), which the bench discards as warm-up anyway."""
    value = float(x[0, 0].item())
    return int(value) if math.isfinite(value) else -1


class _InputPath(torch.autograd.Function):
    """Identity that costs `f` forward and `i` backward: the activation-gradient work of a stage."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stage: int, costs: Costs) -> torch.Tensor:  # type: ignore[override]
        ctx.stage, ctx.costs, ctx.mb = stage, costs, micro_batch_index(x)
        costs.sleep("F", stage, ctx.mb, costs.f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        ctx.costs.sleep("I", ctx.stage, ctx.mb, ctx.costs.i)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    """Zeros shaped like the activation that cost `w` in backward: the weight-gradient work of a stage."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, rows: int, mb: int, stage: int,  # type: ignore[override]
                costs: Costs) -> torch.Tensor:
        ctx.stage, ctx.costs, ctx.mb = stage, costs, mb
        return weight.new_zeros(rows, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.costs.sleep("W", ctx.stage, ctx.mb, ctx.costs.w)
        return grad.sum(0), None, None, None, None


class TimedStage(torch.nn.Module):
    """out = InputPath(x) + WeightPath(weight): values pass through unchanged (column 0 carries the micro-batch
    index for the order check). torch's zero-bubble split differentiates to the stage input first (I runs only
    `_InputPath.backward`, because `_WeightPath` does not lead to the input) and later from the saved gradient of
    the sum to the weight (W runs only `_WeightPath.backward`), so I and W cost exactly `i` and `w`."""

    def __init__(self, stage: int, costs: Costs) -> None:
        super().__init__()
        self.stage, self.costs = stage, costs
        self.weight = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:  # stage 0: a real first stage still back-propagates through its own layers
            x = x.detach().requires_grad_(True)
        h = _InputPath.apply(x, self.stage, self.costs)
        return h + _WeightPath.apply(self.weight, x.shape[0], micro_batch_index(x), self.stage, self.costs)


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    n_micro: int
    stages: int  # per rank
    table: Table
    exposed_ok: bool  # the schedule's own pipeline_order passed validate_table


def plan_cases(schedules: list[str], pps: list[int], micros: list[int], virtual: int) -> tuple[list[Case], list[str]]:
    """Every runnable (schedule, p, m) with its action table; the refused ones as lines for the report."""
    cases, refused = [], []
    grid = [(s, p, m) for p in pps for m in micros for s in schedules]
    for s, p, m in tqdm(grid, desc="action tables", leave=False):
        v = stages_per_rank(s, virtual)
        try:
            table = action_table(s, p, m, virtual)
        except ParallelismError as exc:
            refused.append(f"{s} p={p} m={m}: {str(exc.__cause__ or exc).splitlines()[0]}")
            continue
        ok = not validate_table(table, p * v, m)
        if not ok and schedule_spec(s).shape == "single":
            table = executed_single_stage_table(s, p, m)
        cases.append(Case(s, p, m, v, table, ok))
    return cases, refused


def _one_step(sched: Any, ids: list[int], n_stages: int, costs: Costs, x: torch.Tensor, group: Any,
              ) -> tuple[float, float, float, list[Event]]:
    dist.barrier(group=group)
    costs.log.clear()
    t0 = time.perf_counter()
    run_schedule(sched, ids, n_stages, x, torch.zeros_like(x))
    t1 = time.perf_counter()
    return t0, t1, sum(e[4] - e[3] for e in costs.log), list(costs.log)


def _rank_main(rank: int, world: int, cases: list[Case], unit_s: float, steps: int) -> list[dict[str, Any] | None]:
    groups = {p: dist.new_group(list(range(p))) for p in sorted({c.pp for c in cases})}
    out: list[dict[str, Any] | None] = []
    for case in tqdm(cases, desc="schedules on gloo", disable=rank != 0):
        if rank >= case.pp:
            out.append(None)
            continue
        v, n_stages = case.stages, case.pp * case.stages
        ids = stages_of_rank(rank, case.pp, v, case.schedule)
        costs = Costs()
        parts = [TimedStage(s, costs) for s in ids]
        sched = build_schedule(parts, ids, n_stages, groups[case.pp], torch.device("cpu"), case.schedule,
                               case.n_micro, lambda out, target: (out - target).pow(2).mean())
        x = torch.arange(case.n_micro, dtype=torch.float32).repeat_interleave(2).view(case.n_micro, 2)
        free = [_one_step(sched, ids, n_stages, costs, x, groups[case.pp]) for _ in range(1 + steps)][1:]
        costs.f, costs.i, costs.w = unit_s / v, unit_s / v, unit_s / v
        timed = [_one_step(sched, ids, n_stages, costs, x, groups[case.pp]) for _ in range(steps)]
        out.append({"free": [t[:3] for t in free], "timed": [t[:3] for t in timed], "events": timed[0][3]})
    return out


def _makespans(per_rank: list[list[tuple[float, float, float]]]) -> list[float]:
    return [max(r[k][1] for r in per_rank) - min(r[k][0] for r in per_rank) for k in range(len(per_rank[0]))]


def expected_events(kind: str, stage: int, mb: int) -> list[tuple[str, int, int]]:
    """The sleeps one table action must trigger: F one forward; B both backward paths; with torch's split, I only
    the input path and W only the weight path — except on stage 0, where I does nothing and W runs both."""
    if kind == "F":
        return [("F", stage, mb)]
    if kind == "B" or (kind == "W" and stage == 0):
        return [("I", stage, mb), ("W", stage, mb)]
    if kind == "I":
        return [] if stage == 0 else [("I", stage, mb)]
    return [("W", stage, mb)]


def executed_matches_table(case: Case, events_by_rank: list[list[Event]]) -> bool:
    """Each rank ran its table's actions in order, and each action cost exactly the sleeps it was meant to."""
    for rank, events in enumerate(events_by_rank):
        got = [(k, s, mb) for k, s, mb, _, _ in events]
        pos = 0
        for a in compute_actions(case.table, rank):
            assert a.microbatch_index is not None
            want = expected_events(a.computation_type.value, a.stage_index, a.microbatch_index)
            if sorted(got[pos:pos + len(want)]) != sorted(want):
                return False
            pos += len(want)
        if pos != len(got):
            return False
    return True


def peak_in_flight(events: list[Event]) -> int:
    """Most (stage, micro-batch) activations a rank held at once: from its forward until both backward paths
    (I and W) have run — the memory 1F1B saves over GPipe."""
    live: set[tuple[int, int]] = set()
    grads: dict[tuple[int, int], int] = {}
    peak = 0
    for kind, stage, mb, _, _ in events:
        key = (stage, mb)
        if kind == "F":
            live.add(key)
            peak = max(peak, len(live))
        else:
            grads[key] = grads.get(key, 0) + 1
            if grads[key] == 2:
                live.discard(key)
    return peak


def summarize(cases: list[Case], results: list[list[dict[str, Any] | None]], unit_ms: float) -> list[dict[str, Any]]:
    """One row per case: formula, table simulation, measured idle fraction, runtime overhead, order check."""
    rows = []
    for k, case in enumerate(cases):
        res = [r for r in (results[rank][k] for rank in range(case.pp)) if r is not None]
        assert len(res) == case.pp, f"{case.schedule}: {len(res)} of {case.pp} ranks reported"
        timed = [r["timed"] for r in res]
        spans = [1000 * t for t in _makespans(timed)]
        busy = [[1000 * step[2] for step in rank] for rank in timed]
        # Contention on a shared machine only ever adds time, so the fastest step is the least disturbed one.
        j = spans.index(min(spans))
        idle = sum(1 - busy[r][j] / spans[j] for r in range(case.pp)) / case.pp
        wall_ms, free_ms = spans[j], 1000 * min(_makespans([r["free"] for r in res]))
        n_stages = case.pp * case.stages
        nominal = per_rank_costs(unit_ms, unit_ms, unit_ms, case.schedule, case.stages)
        sim = simulate(case.table, n_stages, nominal)
        # Sleeps overshoot on a loaded machine: simulate with the costs the ops really took.
        scale = statistics.mean(b[j] for b in busy) / statistics.mean(sim.busy.values())
        real = StageCosts(nominal.f * scale, nominal.i * scale, nominal.w * scale)
        o_free = fit_overhead(case.table, n_stages, StageCosts(0.0, 0.0, 0.0), free_ms)
        rows.append({"schedule": case.schedule, "p": case.pp, "m": case.n_micro, "v": case.stages,
                     "formula": bubble_fraction(case.schedule, case.pp, case.n_micro, case.stages),
                     "table": sim.idle_fraction(), "measured": idle, "wall_ms": wall_ms, "table_ms": sim.makespan,
                     "predicted": simulate(case.table, n_stages, real, overhead=o_free).idle_fraction(),
                     "o_free": o_free, "o_timed": fit_overhead(case.table, n_stages, real, wall_ms),
                     "order_ok": executed_matches_table(case, [r["events"] for r in res]),
                     "in_flight": max(peak_in_flight(r["events"]) for r in res) / case.stages,
                     "exposed_ok": case.exposed_ok})
    return rows


def render(rows: list[dict[str, Any]], refused: list[str], args: argparse.Namespace, elapsed: float) -> str:
    """The block this bench owns (table and how it was made); the analysis written after a run follows its end
    marker in the file, so a rerun keeps it."""
    cmd = (f"python bench/pipeline_bubble.py --pp {' '.join(map(str, args.pp))} --micro "
           f"{' '.join(map(str, args.micro))} --unit-ms {args.unit_ms:g} --steps {args.steps}")
    lines = [HEADING, "", f"Command: `{cmd}` ({elapsed:.0f} s; gloo, forked ranks, torch {torch.__version__}).",
             f"Costs per rank per micro-batch: F = I = W = {args.unit_ms:g} ms (B = I + W = 2F), split evenly over "
             "the rank's v stages. Idle = 1 - busy/makespan, mean over ranks, in the fastest timed step (load only "
             "adds time). "
             "*table + o*: the action table simulated with the sleeps' real durations plus o ms of runtime per "
             "action, o fitted to the zero-cost steps of the same run (`o zero-cost`); `o timed` is the o that "
             "reproduces the timed step itself. *Peak in-flight µb*: most micro-batch activations a rank held at "
             "once (forward done, I and W not both done), in units of the rank's whole share of layers.", "",
             "| schedule | p | m | v | formula | action table | table + o | measured | measured/formula "
             "| measured/table | measured/(table + o) | step ms (table) | o zero-cost ms | o timed ms "
             "| peak in-flight µb | order = table |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        note = "" if r["exposed_ok"] else " *"
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['formula']:.3f} | {r['table']:.3f} | "
            f"{r['predicted']:.3f} | {r['measured']:.3f} | {r['measured'] / r['formula']:.2f} | "
            f"{r['measured'] / max(r['table'], 1e-9):.2f} | {r['measured'] / max(r['predicted'], 1e-9):.2f} | "
            f"{r['wall_ms']:.0f} ({r['table_ms']:.0f}) | {r['o_free']:.1f} | {r['o_timed']:.1f} | "
            f"{r['in_flight']:g} | "
            f"{'yes' if r['order_ok'] else 'NO'}{note} |")
    if not all(r["exposed_ok"] for r in rows):
        lines += ["", "\\* the schedule's exposed `pipeline_order` fails `validate_table` (torch's 1F1B table is "
                  "off by one micro-batch on the forwards); the table used is the loop `_step_microbatches` "
                  "executes, and the order check confirms the run followed it."]
    if refused:
        lines += ["", "Refused by torch (not run): " + "; ".join(refused)]
    lines += ["", sensitivity(args.micro[-1], args.pp[-1], args.virtual)]
    return "\n".join(lines) + "\n"


SPLITS = [(1.0, 1.0, 1.0), (1.0, 0.5, 0.5), (1.0, 1.5, 0.5), (1.0, 0.5, 1.5)]


def sensitivity(m: int, pp: int, virtual: int) -> str:
    """Table-only idle fractions when the costs leave the formulas' assumptions (F = I = W), no processes."""
    head = " | ".join(f"F:I:W = {f:g}:{i:g}:{w:g}" for f, i, w in SPLITS)
    lines = [f"Action tables only (no processes), p = {pp}, m = {m}: idle fraction as the cost split changes "
             "(F = I = W is the formulas' assumption; 1:0.5:0.5 is F = B).", "",
             f"| schedule | formula | {head} |", "|---|---:|" + "---:|" * len(SPLITS)]
    for s in SCHEDULES:
        try:
            table = action_table(s, pp, m, virtual)
        except ParallelismError:
            continue
        v = stages_per_rank(s, virtual)
        if validate_table(table, pp * v, m):
            table = executed_single_stage_table(s, pp, m)
        idle = [simulate(table, pp * v, per_rank_costs(f, i, w, s, v)).idle_fraction() for f, i, w in SPLITS]
        lines.append(f"| {s} | {bubble_fraction(s, pp, m, v):.3f} | " + " | ".join(f"{x:.3f}" for x in idle) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline degrees (ranks)")
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8], help="micro-batches per step")
    ap.add_argument("--virtual", type=int, default=2, help="stages per rank of the looped schedules")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--unit-ms", type=float, default=30.0, help="F = I = W per rank and micro-batch (ms)")
    ap.add_argument("--steps", type=int, default=5, help="zero-cost and timed steps per case")
    ap.add_argument("--write", type=Path, help="replace this bench's section in this markdown file")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cases, refused = plan_cases(args.schedules, args.pp, args.micro, args.virtual)
    results = run_distributed(_rank_main, max(c.pp for c in cases), backend="gloo", timeout_s=900,
                              cases=cases, unit_s=args.unit_ms / 1000, steps=args.steps)
    rows = summarize(cases, results, args.unit_ms)
    text = render(rows, refused, args, time.perf_counter() - t0)
    print(text)
    if args.write:
        replace_section(args.write, KEY, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
