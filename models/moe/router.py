"""Token-to-expert routing: softmax or sigmoid top-k, the routing bias of auxiliary-loss-free balancing, and
capacity-based dropping.

Shape legend: N tokens of one token group (B*T of a micro-batch on one data rank), E experts, K top_k, D hidden.
The router runs in fp32 whatever the autocast dtype: its logits decide discrete choices and feed the balancing
losses, and bf16 rounding there flips choices between otherwise identical runs (Switch, "selective precision").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.config import MoEConfig


@dataclass
class Routing:
    """One token group's routing decisions."""

    expert_idx_NK: torch.Tensor
    """Chosen experts per token (int64), best first."""
    weights_NK: torch.Tensor
    """Combine weights of the chosen experts (fp32, differentiable)."""
    probs_NE: torch.Tensor
    """Normalized affinities (softmax probabilities, or sigmoid scores / their sum) for the balancing loss."""
    logits_NE: torch.Tensor
    """Raw router logits (fp32) for the z-loss."""


class Router(nn.Module):
    """Linear gate D -> E and top-k selection.

    `expert_bias` (a persistent buffer, zeros at init) is added to the scores for *selection only*, never to
    the combine weights — DeepSeek-V3's auxiliary-loss-free balancing; `update_bias` moves it after each step.
    """

    expert_bias: torch.Tensor

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.kind = moe.router
        self.renormalize = moe.renormalize
        self.routed_scale = moe.routed_scale
        self.n_groups, self.topk_groups = moe.n_groups, moe.topk_groups
        self.weight = nn.Parameter(torch.empty(moe.n_experts, hidden))
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts), persistent=True)
        self.weight_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Applied to the weight before use; tensor parallelism installs a sum-of-gradients over tp here."""

    def reset_buffers(self) -> None:
        """Zero the routing bias (called by `Decoder.init_weights`, also after meta-device construction)."""
        with torch.no_grad():
            self.expert_bias.zero_()

    def forward(self, x_ND: torch.Tensor) -> Routing:
        with torch.autocast(x_ND.device.type, enabled=False):
            weight = _local(self.weight)
            if self.weight_hook is not None:
                weight = self.weight_hook(weight)
            logits = F.linear(x_ND.float(), weight.float())
        if self.kind == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        select = scores.detach() + self.expert_bias  # the bias steers the choice, not the weights
        if self.n_groups > 1:
            select = limit_groups(select, self.n_groups, self.topk_groups)
        # a stable sort, not topk: ties go to the lower expert index on every device (topk leaves them open)
        expert_idx = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        weights = scores.gather(-1, expert_idx)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        return Routing(expert_idx, weights, probs, logits)

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones by `rate` (DeepSeek-V3 §2.1.2).

        Args:
            counts_E: tokens routed to each expert over the whole step (all micro-batches, all data ranks).
            rate: the update speed gamma.
        """
        counts = counts_E.to(self.expert_bias.device, torch.float32)
        self.expert_bias += rate * torch.sign(counts.mean() - counts)


def limit_groups(select_NE: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): selection scores of experts outside a token's `topk_groups` best
    groups set to -inf. A group's score is the sum of its two highest expert scores (one, for one-expert groups);
    groups are consecutive expert indices. Ties go to the lower group index (stable sort), as for experts."""
    n, e = select_NE.shape
    per_group = select_NE.view(n, n_groups, e // n_groups)
    group_score = per_group.topk(min(2, e // n_groups), dim=-1).values.sum(dim=-1)
    keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
    mask = torch.zeros(n, n_groups, dtype=torch.bool, device=select_NE.device).scatter(1, keep, True)
    return per_group.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(n, e)


def groups_spanned(expert_idx_NK: torch.Tensor, n_experts: int, n_groups: int) -> torch.Tensor:
    """Distinct expert groups among each token's chosen experts (int64, N)."""
    group_NK = expert_idx_NK // (n_experts // n_groups)
    hit = torch.zeros(group_NK.shape[0], n_groups, dtype=torch.bool, device=group_NK.device)
    return hit.scatter(1, group_NK, True).sum(dim=-1)


def _local(w: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor parameter (replicated router under TP), or `w` itself."""
    to_local = getattr(w, "to_local", None)
    return to_local() if callable(to_local) else w


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Assignments one expert accepts from one token group: ceil(factor * tokens * k / experts) (GShard)."""
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def capacity_mask(expert_idx_NK: torch.Tensor, weights_NK: torch.Tensor, n_experts: int, capacity: int
                  ) -> torch.Tensor:
    """Which assignments fit their expert's capacity (bool, N x K).

    Per expert, the `capacity` assignments with the highest routing weight are kept; the lowest-weight ones are
    dropped first, ties broken by token position (earlier kept). The result depends only on this token group,
    so it is the same under every parallel layout that routes the same group.
    """
    flat_e = expert_idx_NK.reshape(-1)
    flat_w = weights_NK.detach().reshape(-1)
    by_weight = torch.sort(flat_w, descending=True, stable=True).indices
    order = by_weight[torch.sort(flat_e[by_weight], stable=True).indices]  # expert-major, weight-descending
    counts = torch.bincount(flat_e, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[order]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(expert_idx_NK)
