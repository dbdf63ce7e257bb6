"""Mixed precision and gradient clipping across every parallel axis.

fp32 master weights always (parameters and optimizer states stay fp32; forward/backward run under autocast).
fp16 uses dynamic loss scaling (Micikevicius et al. 2018): scale the loss, skip the step when any gradient
overflowed anywhere (the check is global), halve the scale on overflow and double it after `growth_interval`
clean steps. bf16 needs no scaling.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Replicate


class LossScaler:
    """Dynamic loss scale; `enabled=False` makes it the identity (scale 1, never skips).

    The same rule and state as torch's `GradScaler` (the 1-process engine's): `good_steps` is its growth tracker.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """{"scale", "growth_tracker"} (empty when disabled): what a resume needs to continue bitwise."""
        return {"scale": self.scale, "growth_tracker": self.good_steps} if self.enabled else {}

    def load_state_dict(self, state: dict[str, float | int] | None) -> None:
        if self.enabled and state:
            self.scale, self.good_steps = float(state["scale"]), int(state["growth_tracker"])


def _is_shard(placement: Placement) -> bool:
    # FSDP over a TP-sharded dim uses _StridedShard, which is not a Shard subclass and says is_shard() False.
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def local_grad(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's piece of p's gradient, how many disjoint pieces the gradient is cut into by sharding)."""
    g = p.grad
    assert g is not None
    if isinstance(g, DTensor):
        pieces = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if _is_shard(pl))
        return g.to_local(), pieces
    return g, 1


def global_grad_norm(params: Iterable[torch.Tensor], copies_per_stage: int, groups: Sequence[dist.ProcessGroup],
                     comm_device: torch.device) -> torch.Tensor:
    """The exact L2 norm of the full gradient, every element counted once (fp64 accumulation, CPU result).

    Each parameter lives on one pipeline stage, whose `copies_per_stage` ranks together hold it: an element
    of a gradient sharded into `pieces` disjoint pieces is held by copies_per_stage / pieces ranks. Summing
    local squares weighted by pieces / copies_per_stage over every rank (all-reduces over `groups`, which
    together span the layout) counts each element exactly once, whatever mix of TP, FSDP and replication.
    """
    sums = []
    for p in params:
        if p.grad is None:
            continue
        g, pieces = local_grad(p)
        sums.append(g.detach().double().pow(2).sum().to(comm_device) * (pieces / copies_per_stage))
    total = torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64, device=comm_device)
    for group in groups:
        dist.all_reduce(total, group=group)
    return total.sqrt().float().cpu()


@torch.no_grad()
def resolve_partial_grads(params: Iterable[torch.Tensor]) -> None:
    """Sum pending (Partial) DTensor gradients now, e.g. of sequence-parallel norm weights, so that every
    gradient is a plain shard or replica for clipping and the optimizer."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])


@torch.no_grad()
def scale_grads(params: Iterable[torch.Tensor], factor: float) -> None:
    if factor == 1.0:
        return
    for p in params:
        if p.grad is not None:
            g, _ = local_grad(p)
            g.mul_(factor)
