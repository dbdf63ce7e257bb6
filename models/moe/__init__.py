"""Mixture-of-experts feed-forward layers (docs/MOE.md).

`MoE(cfg)` replaces the dense MLP on the layers `ModelConfig.is_moe_layer` picks; `models.moe.step` holds the
few calls an engine makes around a step (aux-loss scale, routing-bias update, metrics).
"""

from models.moe.dispatch import Dispatcher, LocalDispatcher, combine, permute
from models.moe.experts import GroupedExperts, grouped_mm_available
from models.moe.layer import MoE
from models.moe.losses import AuxLossInjector, load_balancing_loss, router_z_loss
from models.moe.router import Router, Routing, capacity_mask, expert_capacity
from models.moe.step import (
    collect_aux_loss,
    discard_routing_counts,
    moe_layers,
    moe_metrics,
    moe_stats,
    set_aux_loss_scale,
    update_routing_bias,
)

__all__ = [
    "AuxLossInjector",
    "Dispatcher",
    "GroupedExperts",
    "LocalDispatcher",
    "MoE",
    "Router",
    "Routing",
    "capacity_mask",
    "collect_aux_loss",
    "combine",
    "discard_routing_counts",
    "expert_capacity",
    "grouped_mm_available",
    "load_balancing_loss",
    "moe_layers",
    "moe_metrics",
    "moe_stats",
    "permute",
    "router_z_loss",
    "set_aux_loss_scale",
    "update_routing_bias",
]
