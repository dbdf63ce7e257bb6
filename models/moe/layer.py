"""The MoE feed-forward block that replaces a dense MLP: router -> (capacity) -> dispatch -> experts -> combine,
plus optional always-on shared experts.

Shape legend: B batch, T sequence, D hidden, N = B*T tokens of one token group, K top_k, E experts.
One forward call routes one token group — the micro-batch of one data rank — so capacity and the micro-batch
balancing loss depend only on that group, never on how the rest of the batch is laid out.

Parallelism is installed from outside (framework/parallel/expert.py) by replacing `dispatcher` and setting
`reduce_counts`; the module itself never asks for a process group.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from models.config import ModelConfig
from models.layers import FeedForward
from models.moe.dispatch import Dispatcher, LocalDispatcher
from models.moe.experts import GroupedExperts
from models.moe.losses import AuxLossInjector, load_balancing_loss, router_z_loss
from models.moe.router import Router, capacity_mask, expert_capacity, groups_spanned

# Layout of the per-step statistics vector (float64): counts per expert, then these five scalars.
STAT_FIELDS = ("dropped", "assigned", "lb_loss", "z_loss", "groups", "group_span")
"""groups: token groups routed; group_span: sum over tokens of the expert groups (model.moe.n_groups) a token's
experts lie in."""


class TokenShards(Protocol):
    """The tp ranks' sequence shards of one token group (framework/parallel/expert.py implements it)."""

    def gather(self, t_BtX: torch.Tensor) -> torch.Tensor:
        """Every rank's (B, T/tp, X) -> the group's (B, T, X), in sequence order; no gradient."""
        ...

    def local(self, t_BTX: torch.Tensor) -> torch.Tensor:
        """This rank's (B, T/tp, X) part of a group tensor."""
        ...

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the tp ranks; no gradient."""
        ...


def _recording() -> bool:
    """A training forward that counts: not the recomputation of activation checkpointing inside backward, and
    not the one-off metadata-inference pass of torch.distributed.pipelining (which feeds placeholder tensors)."""
    return (torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
            and not _in_pipeline_metadata_inference())


def _in_pipeline_metadata_inference() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_forward_metadata_inference":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class MoE(nn.Module):
    """Routed experts (+ shared experts) for one layer; forward(x_BTD) -> y_BTD."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.moe_cfg = moe
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        expert_hidden = moe.expert_hidden or cfg.ffn
        self.router = Router(cfg.hidden, moe)
        self.experts = GroupedExperts(moe.n_experts, cfg.hidden, expert_hidden, moe.experts_impl)
        # DeepSeekMoE: the shared experts are one always-on MLP of n_shared * expert_hidden
        self.shared_experts: FeedForward | None = (
            FeedForward(cfg, hidden_ffn=moe.n_shared_experts * expert_hidden) if moe.n_shared_experts else None)
        self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False) if moe.shared_expert_gate else None
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.token_shards: TokenShards | None = None
        """Set under tensor parallelism: this rank holds a sequence shard of the token group."""
        self.reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sum a tensor over the data ranks (set by the parallel engine); None on one process."""
        self.aux_loss_scale = 1.0
        """Gradient the aux loss receives per forward (set by the engine: 1 / micro-batches x loss scale)."""
        self.last_aux_loss: torch.Tensor | None = None
        self.step_stats: torch.Tensor | None = None
        self.bias_counts: torch.Tensor | None = None

    def reset_buffers(self) -> None:
        self.router.reset_buffers()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        if x_BTD.is_meta:  # shape inference (pipeline stages): routing needs values, the output shape does not
            return torch.empty_like(x_BTD)
        x_ND = x_BTD.reshape(b * t, d)
        routing = self.router(x_ND)
        keep_NK, counts_E, dropped, n_group, span = self._decide(routing.expert_idx_NK, routing.weights_NK, b, t)
        y_ND = self.dispatcher(x_ND, routing.expert_idx_NK, routing.weights_NK, keep_NK, self.experts)
        if self.shared_experts is not None:
            shared_ND = self.shared_experts(x_BTD).reshape(b * t, d)
            if self.shared_gate is not None:
                shared_ND = shared_ND * torch.sigmoid(self.shared_gate(x_ND))
            y_ND = y_ND + shared_ND
        y_BTD = y_ND.view(b, t, d).to(x_BTD.dtype)

        scope_counts = counts_E.to(torch.float32)
        if self.moe_cfg.aux_loss_scope == "global_batch" and self.reduce_counts is not None:
            scope_counts = self.reduce_counts(scope_counts)
        # Means over the whole token group: this rank's tokens contribute their share (all of it on one rank).
        share = (b * t) / n_group
        lb = load_balancing_loss(routing.probs_NE, scope_counts) * share
        z = router_z_loss(routing.logits_NE) * share
        aux = self.moe_cfg.aux_loss_coef * lb + self.moe_cfg.z_loss_coef * z
        lb_z = torch.stack([lb.detach(), z.detach()])
        if self.token_shards is not None:
            lb_z = self.token_shards.sum(lb_z)
        self.last_aux_loss = self.moe_cfg.aux_loss_coef * lb_z[0] + self.moe_cfg.z_loss_coef * lb_z[1]
        if _recording():
            self._record(counts_E, dropped, lb_z, span)
        if aux.requires_grad and (self.moe_cfg.aux_loss_coef > 0 or self.moe_cfg.z_loss_coef > 0):
            y_BTD = AuxLossInjector.apply(y_BTD, aux, self.aux_loss_scale)
        return y_BTD

    def _decide(self, idx_NK: torch.Tensor, weights_NK: torch.Tensor, b: int, t: int
                ) -> tuple[torch.Tensor | None, torch.Tensor, int, int, int]:
        """Capacity drops and expert counts over the whole token group.

        Returns (this rank's kept mask or None when dropless, the group's assignments per expert, the group's
        dropped assignments, the group's token count, the expert groups its tokens span in all). Under tensor
        parallelism each tp rank holds a sequence shard of the group: the (detached) choices are all-gathered so
        drops are decided on the whole group, exactly as on one device, and every tp rank reports the same group
        statistics.
        """
        full_idx, full_w = idx_NK, weights_NK.detach()
        if self.token_shards is not None:
            full_idx = self.token_shards.gather(idx_NK.view(b, t, -1)).reshape(-1, self.top_k)
            full_w = self.token_shards.gather(full_w.view(b, t, -1)).reshape(-1, self.top_k)
        n_group = full_idx.shape[0]
        counts_E = torch.bincount(full_idx.reshape(-1), minlength=self.n_experts)
        n_groups = self.moe_cfg.n_groups
        span = int(groups_spanned(full_idx, self.n_experts, n_groups).sum()) if n_groups > 1 and _recording() else 0
        if self.moe_cfg.capacity_factor <= 0:
            return None, counts_E, 0, n_group, span
        cap = expert_capacity(n_group, self.top_k, self.n_experts, self.moe_cfg.capacity_factor)
        keep = capacity_mask(full_idx, full_w, self.n_experts, cap)
        dropped = int((~keep).sum())
        if self.token_shards is not None:
            keep = self.token_shards.local(keep.view(b, -1, self.top_k)).reshape(-1, self.top_k)
        return keep, counts_E, dropped, n_group, span

    @torch.no_grad()
    def _record(self, counts_E: torch.Tensor, dropped: int, lb_z: torch.Tensor, span: int) -> None:
        lb, z = lb_z.tolist()
        scalars = torch.tensor([dropped, int(counts_E.sum()), lb, z, 1.0, span], dtype=torch.float64)
        vec = torch.cat([counts_E.cpu().to(torch.float64), scalars])
        self.step_stats = vec if self.step_stats is None else self.step_stats + vec
        if self.moe_cfg.bias_update_rate > 0:
            c = counts_E.to(torch.float32)
            self.bias_counts = c if self.bias_counts is None else self.bias_counts + c
