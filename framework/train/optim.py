"""AdamW with weight-decay groups; the kernel (fused / foreach / for-loop) chosen for the device."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from framework.train.config import TrainConfig


def param_groups(modules: Iterable[nn.Module], weight_decay: float) -> list[dict[str, object]]:
    """Two groups: matrices decay; norms, biases and embeddings do not (GPT-3, Llama practice).

    Parameters shared between modules (tied embeddings) are listed once.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if p.ndim < 2 or "norm" in name or "embeddings" in name or name.endswith("bias"):
                no_decay.append(p)
            else:
                decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _impl_flags(cfg: TrainConfig, device: torch.device, params: list[torch.Tensor]) -> dict[str, bool]:
    """The AdamW kernel, chosen once the parameters are known: fused and foreach both fail on a mix of DTensors
    and plain tensors (TP without sequence parallelism keeps the norm weights plain; docs/ARCHITECTURE.md, known
    torch traps), so a mix takes the for-loop kernel whatever was asked; otherwise auto is fused on CUDA."""
    from torch.distributed.tensor import DTensor

    impl = cfg.optimizer_impl
    n_dtensor = sum(isinstance(p, DTensor) for p in params)
    if 0 < n_dtensor < len(params):
        if impl in ("fused", "foreach"):
            logging.getLogger(__name__).warning(
                "train.optimizer_impl=%s cannot run over %d DTensor and %d plain parameters (TP without sequence "
                "parallelism); using the for-loop AdamW (turn parallel.sequence_parallel on for %s)",
                impl, n_dtensor, len(params) - n_dtensor, impl)
        impl = "for_loop"
    elif impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def build_optimizer(modules: list[nn.Module], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `modules` (pipeline stages hold several) with decoupled weight decay; with train.optimizer=muon,
    Muon for the hidden matrices (framework/train/muon.py)."""
    groups = param_groups(modules, cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]  # type: ignore[attr-defined]
    flags = _impl_flags(cfg, device, params)
    if cfg.optimizer == "muon":
        from framework.train.muon import Muon, head_blocks, muon_param_groups

        blocks = head_blocks(modules) if cfg.muon.per_head else {}
        return Muon(muon_param_groups(modules, groups), cfg, blocks=blocks, **flags)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **flags)  # type: ignore[arg-type]
