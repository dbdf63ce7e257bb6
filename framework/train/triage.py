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

The same-rank replay also measures the RMS of every block's output (max over the ranks that hold it), and the trainer
hands over the skipped step's gradient norm per block (`Engine.layer_grad_norms`, taken before the step drops the
gradients); both go into the triage record for `tessera doctor`, which names the layers where they are largest.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
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
    layer_rms: list[float] = field(default_factory=list)
    """RMS of each block's output in the same-rank replay, by layer index (max over ranks)."""
    layer_grads: list[float] = field(default_factory=list)
    """The skipped step's gradient norm per block, then the rest (embeddings, final norm, output), before clipping."""

    def record(self, step: int, quarantined_total: int) -> dict[str, Any]:
        return {"type": "triage", "step": step, "verdict": self.verdict, "replay_same_loss": self.replay_same,
                "replay_shifted_loss": self.replay_shifted, "quarantined": self.quarantined,
                "quarantined_total": quarantined_total, "layer_act_rms": self.layer_rms,
                "layer_grad_norm": self.layer_grads}


def _bad(loss: float, guard: LossGuard) -> bool:
    """The guard's judgement of a replayed loss (its history is the accepted steps before the spike)."""
    return not math.isfinite(loss) or (guard.cfg.zscore > 0 and guard.zscore(loss) > guard.cfg.zscore)


def _agree(code: int, device: torch.device) -> int:
    if not dist.is_initialized():
        return code
    t = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)$")  # a decoder block (models/decoder.py), also when compiled/wrapped


def _replay_with_layer_rms(engine: Engine, batch: torch.Tensor, device: torch.device) -> tuple[float, list[float]]:
    """The loss of `batch` (forward only) and the RMS of every block's output in it, by layer index: the max over the
    ranks holding the block (pipeline stages hold different blocks; a block absent everywhere reads -1)."""
    seen: dict[int, float] = {}

    def hook(index: int) -> Any:
        def record(module: Any, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            local = out.to_local() if hasattr(out, "to_local") else out  # a DTensor: this rank's piece
            if isinstance(local, torch.Tensor) and local.numel():
                value, before = float(local.detach().float().pow(2).mean().sqrt()), seen.get(index)
                # max() would drop a NaN (max(0.0, nan) is 0.0): a non-finite output must stay visible
                seen[index] = value if before is None or not math.isfinite(value) or value > before else before
        return record

    handles = [module.register_forward_hook(hook(int(m.group(1))))
               for part in engine.model_parts for name, module in part.named_modules()
               if (m := _BLOCK.search(name.replace("_orig_mod.", "")))]
    try:
        loss = engine.eval_loss(batch)
    finally:
        for handle in handles:
            handle.remove()
    size = torch.tensor([max(seen, default=-1) + 1], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
    rms = torch.full((int(size.item()),), -1.0, dtype=torch.float64, device=device)
    for index, value in seen.items():
        rms[index] = value if math.isfinite(value) else float("inf")  # a NaN would not survive the MAX
    if dist.is_initialized():
        dist.all_reduce(rms, op=dist.ReduceOp.MAX)
    return loss, rms.cpu().tolist()


def triage(engine: Engine, loader: BatchLoader, batch: torch.Tensor, start: int, guard: LossGuard,
           device: torch.device, layer_grads: list[float] | None = None) -> Triage:
    """Classify the skipped step whose global batch the loader read from position `start` (module docstring)."""
    same, layer_rms = _replay_with_layer_rms(engine, batch, device)
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
    return Triage(VERDICTS[code], same, shifted_loss, quarantined, layer_rms, list(layer_grads or []))
