"""Permute token-expert assignments by expert, run the experts, and combine back — on one device.

The expert-parallel dispatcher (framework/parallel/expert.py) reuses `permute` and `combine` around its
all-to-all, so both paths order rows, and sum each token's k expert outputs, the same way.

Shape legend: N tokens, K top_k, D hidden, M kept assignments, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from models.moe.experts import GroupedExperts


@dataclass
class Permutation:
    """Kept assignments sorted by expert (stable: token order within an expert)."""

    slots_M: torch.Tensor
    """Flat (token * K + k) slot of each sorted row."""
    tokens_M: torch.Tensor
    """Source token of each sorted row."""
    counts_E: torch.Tensor
    """Rows per expert (int64, all E experts)."""


def permute(expert_idx_NK: torch.Tensor, keep_NK: torch.Tensor | None, n_experts: int) -> Permutation:
    """Sort the kept (token, k) assignments by expert."""
    flat_e = expert_idx_NK.reshape(-1)
    slots = torch.arange(flat_e.numel(), device=flat_e.device)
    if keep_NK is not None:
        kept = keep_NK.reshape(-1)
        slots, flat_e = slots[kept], flat_e[kept]
    order = torch.sort(flat_e, stable=True).indices
    slots = slots[order]
    return Permutation(slots, slots // expert_idx_NK.shape[1], torch.bincount(flat_e, minlength=n_experts))


def combine(y_MD: torch.Tensor, perm: Permutation, weights_NK: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, k = 0..K-1 in order (dropped slots add zero) -> (N, D).

    Written as scatter-into-slots then a sum over K, not `index_add`, so the summation order is fixed and
    identical on every device and layout.
    """
    n, k = weights_NK.shape
    slots = y_MD.new_zeros(n * k, y_MD.shape[-1])
    slots = slots.index_copy(0, perm.slots_M, y_MD)
    return (slots.view(n, k, -1) * weights_NK.unsqueeze(-1).to(y_MD.dtype)).sum(dim=1)


class Dispatcher(Protocol):
    """Moves a token group's routed rows to their experts and the results back."""

    def __call__(self, x_ND: torch.Tensor, expert_idx_NK: torch.Tensor, weights_NK: torch.Tensor,
                 keep_NK: torch.Tensor | None, experts: GroupedExperts) -> torch.Tensor:
        ...


class LocalDispatcher:
    """All experts on this device (no expert parallelism)."""

    def __call__(self, x_ND: torch.Tensor, expert_idx_NK: torch.Tensor, weights_NK: torch.Tensor,
                 keep_NK: torch.Tensor | None, experts: GroupedExperts) -> torch.Tensor:
        perm = permute(expert_idx_NK, keep_NK, experts.w1.shape[0])
        y_MD = experts(x_ND[perm.tokens_M], perm.counts_E)
        return combine(y_MD, perm, weights_NK)
