"""Pipeline bubble: the idle fraction of a pipeline rank's step, per schedule.

With p stages, m micro-batches and v chunks per rank:
  GPipe, 1F1B                    (p-1) / (m + p - 1)          Huang et al. 2019; Narayanan et al. 2021
  Interleaved1F1B, LoopedBFS     (p-1) / (v·m + p - 1)        Narayanan et al. 2021 (each chunk is 1/v as long)
  InterleavedZeroBubble          (p-1) / (3·v·m + p - 1)      ZB-H1 on interleaved chunks
  ZBVZeroBubble, DualPipeV       (p-1) / (6·m + p - 1)        ZB-V (v = 2) / DualPipeV
The zero-bubble rows follow Qi et al. 2023 (Zero Bubble Pipeline Parallelism) with the backward split into
input-gradient (B) and weight-gradient (W) passes of equal cost to the forward (T_F = T_B = T_W): 1F1B idles
(p-1)(T_F + T_B + T_W) per step, ZB-H1 only (p-1)(T_F + T_B - T_W), a third. For the V-shaped schedules the
paper's ideal is zero; the planner charges them the ZB-H1 third on their two chunks, which keeps them from
looking free when m is small (fill and drain still cost one chunk per stage).
"""

from __future__ import annotations


def bubble_fraction(schedule: str, pp: int, n_micro: int, virtual: int = 1) -> float:
    """Idle fraction of the step on a pipeline rank (0 without pipelining)."""
    p, m, v = pp, n_micro, virtual
    if p <= 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        return (p - 1) / (v * m + p - 1)
    if schedule == "InterleavedZeroBubble":
        return (p - 1) / (3 * v * m + p - 1)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return (p - 1) / (6 * m + p - 1)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


__all__ = ["bubble_fraction"]
