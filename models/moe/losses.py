"""Router losses and how their gradients reach the training loss.

The aux losses are not returned through the model's outputs: under pipeline parallelism the loss function sees
only the last stage, while MoE layers sit on every stage. Instead each MoE layer attaches its aux loss to its
own output with `AuxLossInjector` (the trick of Megatron-core's MoEAuxLossAutoScaler): forward is the identity,
and when the main loss's backward reaches that output it also sends d(aux)/d(router) = `scale` into the aux
loss. Every engine, pipelined or not, then only sets `scale` (1 / micro-batches, times any loss scale) with
`models.moe.set_aux_loss_scale`.
"""

from __future__ import annotations

from typing import Any

import torch


def load_balancing_loss(probs_NE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Switch/GShard balancing loss E * sum_i f_i * P_i (Fedus et al. 2021, eq. 4; Lepikhin et al. 2020).

    Args:
        probs_NE: normalized router affinities of this token group (differentiable).
        counts_E: assignments per expert before capacity dropping, over the scope of the loss (this token group,
            or summed over the data ranks for the global-batch scope); f_i = counts_i / sum(counts).

    Returns:
        The loss, 1.0 for a perfectly uniform router, up to E when all tokens go to one expert.
    """
    n_experts = probs_NE.shape[-1]
    f = counts_E.to(probs_NE.dtype) / counts_E.sum().clamp_min(1)
    return n_experts * (f.detach() * probs_NE.mean(dim=0)).sum()


def router_z_loss(logits_NE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits_NE.float(), dim=-1).pow(2).mean()


class AuxLossInjector(torch.autograd.Function):
    """y = x in forward; in backward, `aux` receives gradient `scale` alongside x's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None
