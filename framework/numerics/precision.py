"""Compute dtypes, autocast, fp16 loss scaling and the end of an optimizer step: one copy for both engines.

fp32 master weights always (parameters and optimizer states stay fp32; forward/backward run under autocast).
fp16 uses dynamic loss scaling (Micikevicius et al. 2018): scale the loss, skip the step when any gradient
overflowed anywhere (the parallel engine's check is global), halve the scale on overflow and double it after
`growth_interval` clean steps. bf16 needs no scaling.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""`train.precision` -> the compute dtype."""


def low_precision_dtype(precision: str) -> torch.dtype | None:
    """The 16-bit compute dtype of `precision` (what FSDP may all-gather in), None for fp32."""
    dtype = DTYPES[precision]
    return None if dtype == torch.float32 else dtype


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


class LossScaler:
    """Dynamic loss scale; `enabled=False` makes it the identity (scale 1, never skips).

    The rule and state of torch's `GradScaler`, which it replaced in the 1-process engine bitwise: the scale is
    held as an fp32 value (GradScaler keeps it in an fp32 tensor, so an `init_scale` of 1e30 means fp32(1e30)),
    unscaling multiplies by the fp32 reciprocal, and `good_steps` is the growth tracker.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = _fp32(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, grads: Iterable[torch.Tensor]) -> bool:
        """Unscale plain (1-process) gradients in place; True when one of them holds an inf or NaN.

        A parallel engine unscales its sharded gradients itself and reads the overflow off the global norm.
        """
        if not self.enabled:
            return False
        inv = _fp32(1.0 / self.scale)
        found_inf = False
        for g in grads:  # checked before unscaling, as GradScaler does (a scale below 1 can overflow a finite g)
            found_inf = found_inf or not bool(torch.isfinite(g).all())
            g.mul_(inv)
        return found_inf

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale = _fp32(self.scale * self.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = _fp32(self.scale * self.growth_factor)
            self.scale = grown if math.isfinite(grown) else self.scale  # GradScaler never grows to inf
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """{"scale", "growth_tracker"} (empty when disabled): what a resume needs to continue bitwise."""
        return {"scale": self.scale, "growth_tracker": self.good_steps} if self.enabled else {}

    def load_state_dict(self, state: dict[str, float | int] | None) -> None:
        if self.enabled and state:
            self.scale, self.good_steps = _fp32(float(state["scale"])), int(state["growth_tracker"])


def finish_step(optimizers: Sequence[torch.optim.Optimizer], scaler: LossScaler, lr: float, *, apply: bool,
                overflow: bool) -> bool:
    """The end of every optimizer step, both engines: set `lr`, step unless the guard said no (`apply` False)
    or the fp16 gradients overflowed, drop the gradients either way, move the loss scale. True when applied.

    A guard skip leaves the loss scale and its growth tracker alone; an overflow backs the scale off.
    """
    applied = apply and not overflow
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
        if applied:
            opt.step()
        opt.zero_grad(set_to_none=True)
    if applied or overflow:
        scaler.update(overflow)
    return applied
