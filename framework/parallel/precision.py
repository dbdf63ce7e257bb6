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


_Kind = tuple[torch.device, torch.dtype, int]


def _local_grads_by_kind(params: Iterable[torch.Tensor]) -> dict[_Kind, list[torch.Tensor]]:
    """This rank's gradient pieces grouped by (device, dtype, pieces): one foreach call per group."""
    out: dict[_Kind, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g, pieces = local_grad(p)
        out.setdefault((g.device, g.dtype, pieces), []).append(g)
    return out


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], copies_per_stage: int, groups: Sequence[dist.ProcessGroup],
                     comm_device: torch.device) -> torch.Tensor:
    """The exact L2 norm of the full gradient, every element counted once (fp64 result on `comm_device`, CPU copy).

    Each parameter lives on one pipeline stage, whose `copies_per_stage` ranks together hold it: an element
    of a gradient sharded into `pieces` disjoint pieces is held by copies_per_stage / pieces ranks. Summing
    local squares weighted by pieces / copies_per_stage over every rank (all-reduces over `groups`, which
    together span the layout) counts each element exactly once, whatever mix of TP, FSDP and replication.

    One `torch._foreach_norm` per (device, dtype, pieces) group reads every local gradient once and returns one
    fp32 norm per tensor (as torch's `clip_grad_norm_(foreach=True)`); only those per-tensor squares are summed
    in fp64, so no fp64 copy of any gradient is made and the kernel count does not grow with the parameter count.
    """
    sums = []
    for (_, dtype, pieces), grads in _local_grads_by_kind(params).items():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32 if dtype != torch.float64 else None)
        squares = torch.stack(norms).double().square().sum()
        sums.append(squares.to(comm_device) * (pieces / copies_per_stage))
    total = torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64, device=comm_device)
    for group in groups:
        dist.all_reduce(total, group=group)
    return total.sqrt().float().cpu()


@torch.no_grad()
def grad_norms_by_bucket(params: Iterable[tuple[int, torch.Tensor]], buckets: int, copies_per_stage: int,
                         groups: Sequence[dist.ProcessGroup], comm_device: torch.device) -> list[float]:
    """`global_grad_norm` per bucket (e.g. a decoder block), every element counted once by the same weighting; one
    vector of `buckets` squares is reduced over `groups`, so every rank calls it alike whatever its stage holds.
    One norm per tensor: meant for a diagnosis (a loss spike), not for every step."""
    squares = torch.zeros(buckets, dtype=torch.float64, device=comm_device)
    for bucket, p in params:
        if p.grad is None:
            continue
        g, pieces = local_grad(p)
        norm = torch.linalg.vector_norm(g, dtype=torch.float32 if g.dtype != torch.float64 else None)
        squares[bucket] += norm.double().square().to(comm_device) * (pieces / copies_per_stage)
    for group in groups:
        dist.all_reduce(squares, group=group)
    return [float(x) for x in squares.sqrt().cpu()]


@torch.no_grad()
def resolve_partial_grads(params: Iterable[torch.Tensor]) -> None:
    """Sum pending (Partial) DTensor gradients now, e.g. of sequence-parallel norm weights, so that every
    gradient is a plain shard or replica for clipping and the optimizer."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])


def clip_factor(norm: float, max_norm: float) -> float:
    """The factor that brings a gradient of global `norm` down to `max_norm`, never above 1: torch's
    `clip_grad_norm_` rule, `max_norm / (norm + 1e-6)` (the same eps, so both engines clip alike)."""
    return min(1.0, max_norm / (norm + 1e-6))


@torch.no_grad()
def scale_grads(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every local gradient piece by `factor` in place: one `torch._foreach_mul_` per (device, dtype)."""
    if factor == 1.0:
        return
    by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for (device, dtype, _), grads in _local_grads_by_kind(params).items():
        by_dtype.setdefault((device, dtype), []).extend(grads)
    for grads in by_dtype.values():
        torch._foreach_mul_(grads, factor)
