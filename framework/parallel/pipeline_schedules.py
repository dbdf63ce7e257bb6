"""The pipeline-schedule table: every fact about a schedule that the config, the mesh, the engine, the planner
and the schedule simulator use, in one entry per schedule. Adding a schedule is one `register_schedule` call.

With p pipeline ranks, m micro-batches and v stages (chunks) per rank:

  name                   stages per rank  fewest m  bubble (idle fraction)        source
  GPipe                  1                p         (p-1) / (m + p - 1)           Huang et al. 2019
  1F1B                   1                p         (p-1) / (m + p - 1)           Narayanan et al. 2021
  Interleaved1F1B        v (looped)       p         (p-1) / (v·m + p - 1)         Narayanan et al. 2021
  LoopedBFS              v (looped)       p         (p-1) / (v·m + p - 1)         Lamy-Poirier 2023
  InterleavedZeroBubble  v (looped)       p         (p-1) / (3·v·m + p - 1)       Qi et al. 2023 (ZB-H1)
  ZBVZeroBubble          2 (a V)          p         (p-1) / (6·m + p - 1)         Qi et al. 2023 (ZB-V)
  DualPipeV              2 (a V)          2p        (p-1) / (6·m + p - 1)         DeepSeek-V3 report

The zero-bubble rows split the backward into input-gradient (B) and weight-gradient (W) passes of equal cost to
the forward (T_F = T_B = T_W): 1F1B idles (p-1)(T_F + T_B + T_W) per step, ZB-H1 only (p-1)(T_F + T_B - T_W),
a third. For the V-shaped schedules the paper's ideal is zero; the planner charges them the ZB-H1 third on their
two chunks, which keeps them from looking free when m is small (fill and drain still cost one chunk per stage).
`in_flight` is the activation memory a pipeline rank holds, in L-layer multiples of one micro-batch's: its chunk
forwards alive at once (from the forward until the backward that frees them: B, or W after a split I, whose
autograd graph torch retains) over the p·v chunks of a micro-batch (Korthikanti et al. 2022 §4.2.3 for the
interleaved factor). Each entry is what torch's own action tables give (tests/parallel/test_in_flight_vs_torch.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from framework.base.errors import ConfigError

Shape = Literal["single", "looped", "v"]


class UnknownScheduleError(ConfigError, ValueError):
    """A pipeline schedule name not in the table (a ValueError too: the planner's formulas raised one)."""


@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    """The name in parallel.pp_schedule and the planner's --schedules."""
    torch_class: str
    """The torch.distributed.pipelining class, by the name its `get_schedule_class` accepts."""
    shape: Shape
    """single: one stage per rank; looped: v stages r, r+p, ...; v: two stages r and 2p-1-r (stage 0 and the
    last stage on rank 0)."""
    bubble: Callable[[int, int, int], float]
    """(p, m, v) -> idle fraction of a rank's step, p > 1."""
    in_flight: Callable[[int, int, int, int], float]
    """(p, m, v, rank) -> the rank's in-flight activations over one micro-batch's L layers, p > 1 (read for rank 0
    only unless `every_rank_in_flight`)."""
    min_micro_per_rank: int = 1
    """The fewest micro-batches are this x p (torch's constructors refuse fewer)."""
    whole_rounds: bool = False
    """Micro-batches must be a multiple of the max(1, m // p) rounds the schedule runs."""
    split_backward: bool = False
    """Runs the input and weight halves of the backward separately (zero bubble): torch refuses compiled stages."""
    forwards_first: bool = False
    """A single-stage schedule that runs every forward before any backward (GPipe), else 1F1B's order."""
    every_rank_in_flight: bool = False
    """`in_flight` gives every pipeline rank's count; otherwise only rank 0's, and rank r holds p - r micro-batches,
    as in 1F1B."""

    def stages_per_rank(self, virtual: int) -> int:
        return {"single": 1, "v": 2}.get(self.shape, virtual)

    def default_virtual(self) -> int:
        return 1 if self.shape == "single" else 2

    def min_micro_batches(self, pp: int) -> int:
        return self.min_micro_per_rank * pp


def _one_f_one_b(p: int, m: int, v: int) -> float:
    return (p - 1) / (m + p - 1)


def _interleaved(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def _zb_v(p: int, m: int, v: int) -> float:
    return (p - 1) / (6 * m + p - 1)


def _all_micro(p: int, m: int, v: int, rank: int) -> float:
    return m / p


def _one_f_one_b_in_flight(p: int, m: int, v: int, rank: int) -> float:
    return min(p, m) / p


def _zb_v_in_flight(p: int, m: int, v: int, rank: int) -> float:
    """ZB-V: rank r warms up m + 1 + r of its 2p chunk forwards (stage 0 the fewest: it also holds the V's last
    stage, whose backward follows its forward at once), all 2p once m ≥ 2p - 1, over its 2 of the 2p chunks."""
    return min(2 * p, m + 1 + rank) / (2 * p)


def _dual_pipe_v_in_flight(p: int, m: int, v: int, rank: int) -> float:
    """DualPipeV: every rank holds 2p + 1 chunk forwards (p + 1/2 micro-batches; m ≥ 2p)."""
    return (2 * p + 1) / (2 * p)


def _interleaved_in_flight(p: int, m: int, v: int, rank: int = 0, hop: int = 2) -> float:
    """Chunk forwards alive on `rank` at its first backward, over the p·v chunks of one micro-batch: torch's warm-up
    (`_get_warmup_ops`: (v-1) micro-batches per round + `hop` per rank after this one: 2 for Interleaved1F1B, 1
    for InterleavedZeroBubble) plus the steady state's first forward, capped at all m·v forwards. On rank 0 and
    for m ≥ 2p this is Korthikanti's 1 + (p-1)/(p·v); at m = p the cap binds (1.0, not 1.44: the dry run of
    GPT-3-175B at p = m = 8 measured it, docs/PLANNER.md)."""
    per_round = m // max(1, m // p)
    return min((v - 1) * per_round + hop * (p - 1 - rank) + 1, m * v) / (p * v)


def _interleaved_1f1b_in_flight(p: int, m: int, v: int, rank: int) -> float:
    return _interleaved_in_flight(p, m, v, rank, hop=2)


def _interleaved_zb_in_flight(p: int, m: int, v: int, rank: int) -> float:
    """Every rank holds rank 0's count: the later ranks warm up less, but each defers its weight passes (W) and
    torch keeps a chunk's autograd graph from its input pass (I) until its W."""
    return _interleaved_in_flight(p, m, v, 0, hop=1)


SCHEDULES: dict[str, PipelineSchedule] = {}
"""Every known schedule by name, in registration order (fill it through `register_schedule`)."""


def register_schedule(spec: PipelineSchedule) -> PipelineSchedule:
    """Add `spec` to the table (every consumer reads the table, so this is all a new schedule needs)."""
    if spec.name in SCHEDULES:
        raise ConfigError(f"pipeline schedule {spec.name!r} is already registered")
    SCHEDULES[spec.name] = spec
    return spec


def unregister_schedule(name: str) -> None:
    SCHEDULES.pop(name, None)


def schedule_spec(name: str) -> PipelineSchedule:
    """The table entry of `name`; ConfigError naming the closest schedules when there is none."""
    spec = SCHEDULES.get(name)
    if spec is None:
        lower = {s.lower(): s for s in SCHEDULES}
        close = [lower[c] for c in difflib.get_close_matches(name.lower(), list(lower), n=2)]
        raise UnknownScheduleError(
            f"parallel.pp_schedule={name!r} is not a pipeline schedule; "
            + (f"did you mean {', '.join(close)}? " if close else "") + f"valid: {', '.join(SCHEDULES)}")
    return spec


for _spec in (
    PipelineSchedule(name="GPipe", torch_class="GPipe", shape="single", bubble=_one_f_one_b, in_flight=_all_micro,
                     forwards_first=True, every_rank_in_flight=True),
    PipelineSchedule(name="1F1B", torch_class="1F1B", shape="single", bubble=_one_f_one_b,
                     in_flight=_one_f_one_b_in_flight),
    PipelineSchedule(name="Interleaved1F1B", torch_class="Interleaved1F1B", shape="looped", bubble=_interleaved,
                     in_flight=_interleaved_1f1b_in_flight, whole_rounds=True, every_rank_in_flight=True),
    PipelineSchedule(name="LoopedBFS", torch_class="LoopedBFS", shape="looped", bubble=_interleaved,
                     in_flight=_all_micro, every_rank_in_flight=True),
    PipelineSchedule(name="InterleavedZeroBubble", torch_class="InterleavedZeroBubble", shape="looped",
                     bubble=lambda p, m, v: (p - 1) / (3 * v * m + p - 1), in_flight=_interleaved_zb_in_flight,
                     whole_rounds=True, split_backward=True, every_rank_in_flight=True),
    PipelineSchedule(name="ZBVZeroBubble", torch_class="ZBVZeroBubble", shape="v", bubble=_zb_v,
                     in_flight=_zb_v_in_flight, split_backward=True, every_rank_in_flight=True),
    PipelineSchedule(name="DualPipeV", torch_class="DualPipeV", shape="v", bubble=_zb_v,
                     in_flight=_dual_pipe_v_in_flight, min_micro_per_rank=2, split_backward=True,
                     every_rank_in_flight=True),
):
    register_schedule(_spec)


def _whole_rounds_fit(pp: int, n_micro: int) -> bool:
    return n_micro % max(1, n_micro // pp) == 0


def min_micro_batches(schedule: str, pp: int) -> int:
    """The fewest micro-batches `schedule` runs on `pp` ranks (DualPipeV needs one per stage: 2 x pp)."""
    return schedule_spec(schedule).min_micro_batches(pp)


def schedule_micro_batch_problem(schedule: str, pp: int, n_micro: int) -> str:
    """Why `schedule` cannot run `n_micro` micro-batches on `pp` ranks ("" when it can).

    The same conditions torch's schedule constructors check, so a layout fails before launch, not in N ranks.
    """
    spec = schedule_spec(schedule)
    need = spec.min_micro_batches(pp)
    if n_micro < need:
        what = (f"{spec.min_micro_per_rank} x parallel.pp (one per stage of the V)" if spec.min_micro_per_rank > 1
                else "parallel.pp")
        return f"{schedule} needs at least {what} = {need} (fewer would idle stages)"
    if spec.whole_rounds and not _whole_rounds_fit(pp, n_micro):
        lower = next(n for n in range(n_micro - 1, 0, -1) if _whole_rounds_fit(pp, n))
        upper = next(n for n in range(n_micro + 1, 4 * n_micro) if _whole_rounds_fit(pp, n))
        return (f"{schedule} runs max(1, m // pp) = {n_micro // pp} rounds and needs m to be a multiple of them; "
                f"the nearest that fit are {lower} and {upper}")
    return ""


def stages_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Stage indices held by pipeline rank `pp_rank`: looped (r, r+pp, ...) or V-shaped (r, 2pp-1-r)."""
    if schedule_spec(schedule).shape == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def bubble_fraction(schedule: str, pp: int, n_micro: int, virtual: int = 1) -> float:
    """Idle fraction of the step on a pipeline rank (0 without pipelining)."""
    if pp <= 1:
        return 0.0
    return schedule_spec(schedule).bubble(pp, n_micro, virtual)


def in_flight_factor(schedule: str, pp: int, n_micro: int, virtual: int = 1, rank: int = 0) -> float:
    """Layers' worth of one micro-batch's activations that pipeline rank `rank` holds (the first by default) under
    the schedules whose every rank holds several (`every_rank_in_flight`), over n_layers."""
    if pp == 1:
        return 1.0
    return schedule_spec(schedule).in_flight(pp, n_micro, virtual, rank)


def rank_in_flight(schedule: str, pp: int, n_micro: int, virtual: int, rank: int) -> float:
    """Micro-batches' worth of its own layers' activations pipeline rank `rank` holds at its peak: `in_flight` in
    micro-batches (stage 0's; every rank's under `every_rank_in_flight`), else 1F1B's p - rank."""
    spec = schedule_spec(schedule)
    if pp == 1 or rank == 0 or spec.every_rank_in_flight:
        return in_flight_factor(schedule, pp, n_micro, virtual, rank) * pp
    return max(1.0, float(pp - rank)) if n_micro >= pp else 1.0


__all__ = ["SCHEDULES", "PipelineSchedule", "UnknownScheduleError", "bubble_fraction", "in_flight_factor",
           "min_micro_batches", "rank_in_flight", "register_schedule", "schedule_micro_batch_problem", "schedule_spec",
           "stages_of_rank", "unregister_schedule"]
