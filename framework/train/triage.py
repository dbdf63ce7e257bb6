"""Spike triage: when the loss guard skips a step, replay it to tell a data-induced spike from a hardware fault.

    verdict = triage(engine, loader, batch, start, guard)      # every rank, right after the skipped step

1. Replay the same rows on the same ranks (forward only). A spike that does not come back is not a property of
   the data: a transient device or link fault ("hardware": nothing is quarantined).
2. Replay with the rows shifted one data rank on (rank r computes what rank r+1 held). A spike that comes back
   from other devices is carried by the data ("data"): the step's global batch goes to the loader's quarantine
   (data_pipeline/read/loader.py), skipped on this and every later start, and the loader steps back so the next
   step reads the samples that follow. A spike that comes back on the same ranks but not when the rows move is
   tied to those devices ("hardware", reproducible).

Every input to the decision is a global loss (all-reduced inside the engine), so every rank decides the same; the
verdict is also all-reduced (max) once, so even a rank whose replay differed cannot disagree: one rank's NaN
makes the global loss NaN on all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from data_pipeline.read.loader import BatchLoader
from framework.base.logs import get_logger
from framework.checkpoint.guard import LossGuard
from framework.engine import Engine

log = get_logger("triage")

VERDICTS = ("hardware", "hardware_reproducible", "data")


@dataclass(frozen=True)
class Triage:
    verdict: str
    """One of VERDICTS."""
    replay_same: float
    replay_shifted: float
    quarantined: list[int]

    def record(self, step: int, quarantined_total: int) -> dict[str, Any]:
        return {"type": "triage", "step": step, "verdict": self.verdict, "replay_same_loss": self.replay_same,
                "replay_shifted_loss": self.replay_shifted, "quarantined": self.quarantined,
                "quarantined_total": quarantined_total}


def _bad(loss: float, guard: LossGuard) -> bool:
    """The guard's judgement of a replayed loss (its history is the accepted steps before the spike)."""
    return not math.isfinite(loss) or (guard.cfg.zscore > 0 and guard.zscore(loss) > guard.cfg.zscore)


def _agree(code: int, device: torch.device) -> int:
    if not dist.is_initialized():
        return code
    t = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def triage(engine: Engine, loader: BatchLoader, batch: torch.Tensor, start: int, guard: LossGuard,
           device: torch.device) -> Triage:
    """Classify the skipped step whose global batch the loader read from position `start` (module docstring)."""
    same = engine.eval_loss(batch)
    shifted_loss = float("nan")
    code = 0
    if _bad(same, guard):
        shifted = BatchLoader(loader.samples, global_batch_size=loader.global_batch_size,
                              micro_batch_size=loader.micro_batch_size, dp_rank=(loader.dp_rank + 1) % loader.dp_size,
                              dp_size=loader.dp_size, consumed_samples=start)
        shifted.quarantine = loader.quarantine
        shifted_loss = engine.eval_loss(shifted.next_batch())
        code = 2 if _bad(shifted_loss, guard) else 1
    code = _agree(code, device)
    quarantined = loader.quarantine_batch(start) if VERDICTS[code] == "data" else []
    log.warning("triage: replayed the skipped step: same ranks loss %s, shifted ranks loss %s -> %s%s", same,
                shifted_loss, VERDICTS[code], f"; quarantined samples {quarantined}" if quarantined else "")
    return Triage(VERDICTS[code], same, shifted_loss, quarantined)
