"""Activation recomputation (Chen et al. 2016; selective: Korthikanti et al. 2022) on every k-th block.

full: a block keeps only its input and recomputes everything in backward.
selective: a per-op policy (`create_selective_checkpoint_contexts`) keeps the outputs of matmuls (the MoE
experts' grouped GEMMs and FP8 scaled GEMMs included), the attention kernel and tensor-parallel reductions (the
expensive or communicating ops) and recomputes the cheap element-wise ones (norms, RoPE, SiLU, residual adds).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from framework.base.errors import ConfigError


def _save_list() -> set[Any]:
    aten = torch.ops.aten
    ops: set[Any] = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in ("_grouped_mm", "_scaled_grouped_mm", "_scaled_mm"):  # MoE experts' grouped GEMMs, FP8 GEMMs
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    return ops


SAVED_OPS = _save_list()


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def apply_recompute(layers: nn.ModuleDict, mode: str, every: int = 1) -> int:
    """Wrap the blocks of `layers` whose layer index % `every` == 0; returns how many were wrapped."""
    if mode == "none":
        return 0
    if mode not in ("full", "selective"):
        raise ConfigError(f"parallel.recompute={mode!r} must be none, full or selective")
    wrapped = 0
    for key in list(layers.keys()):
        if int(key) % every:
            continue
        kwargs: dict[str, Any] = {"preserve_rng_state": False}
        if mode == "selective":
            kwargs["context_fn"] = selective_context
        layers[key] = checkpoint_wrapper(layers[key], **kwargs)
        wrapped += 1
    return wrapped
