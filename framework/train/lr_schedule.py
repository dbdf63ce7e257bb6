"""Learning-rate schedules as pure functions of the step (so resume needs no scheduler state beyond the step)."""

from __future__ import annotations

import math
from typing import Any

from framework.train.config import TrainConfig


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based: the update that produces step `step + 1`).

    warmup: linear from lr/warmup to lr over `warmup_steps`; then
    cosine: half-cosine from lr to min_lr over the remaining steps (Loshchilov & Hutter 2017);
    linear: linear decay to min_lr;
    wsd: constant lr, then a linear decay to min_lr over the last `decay_fraction` of the steps
         (warmup-stable-decay, Hu et al. 2024, MiniCPM);
    constant: lr after warmup.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
        decay_start = cfg.steps - decay_steps
        if step < decay_start:
            return peak
        frac = min(1.0, (step - decay_start + 1) / decay_steps)
        return peak + (floor - peak) * frac
    span = max(1, cfg.steps - cfg.warmup_steps)
    frac = min(1.0, max(0.0, (step - cfg.warmup_steps + 1) / span))
    if cfg.schedule == "linear":
        return peak + (floor - peak) * frac
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * frac))


def section_lr_at(train: dict[str, Any], step: int) -> float:
    """`lr_at` of a `train` config section given as a dict (a checkpoint's saved config; unknown keys ignored)."""
    known = set(TrainConfig.__dataclass_fields__)
    return lr_at(TrainConfig(**{k: v for k, v in train.items() if k in known}), step)
