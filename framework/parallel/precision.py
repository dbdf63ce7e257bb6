"""Gradient clipping and the gradient reductions precision needs, across every parallel axis.

The dtypes, autocast and the fp16 loss scaler both engines use are framework/numerics/precision.py; here is what
only a layout needs: the exact global norm of sharded gradients (which is also the fp16 overflow check), partial
TP gradients summed, and sharded gradients scaled in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Replicate


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
