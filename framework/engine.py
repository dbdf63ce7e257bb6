"""The seam between the training loop and the engines, and what both engines share.

The loop (framework/train/trainer.py) only talks to an `Engine`: it hands over this rank's micro-batches for
one optimizer step and gets back the global mean loss. Two engines implement it, side by side in
framework/train: `LocalEngine` (one process, the reference) and `ParallelEngine` (any layout, over the model
framework/parallel/parallelize.py builds). The loss helper here is used by both and by framework/parallel, which is
why it lives in neither; dtypes, autocast and loss scaling are framework/numerics.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Engine(Protocol):
    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    device: torch.device
    dp_rank: int
    dp_size: int

    def forward_backward(self, batch: torch.Tensor) -> float:
        """Forward and backward over this rank's micro-batches (n_micro, B, T+1); return the global mean loss."""
        ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip gradients to `max_norm` (0: measure only) and return the global norm before clipping."""
        ...

    def grads_overflowed(self) -> bool:
        """fp16: whether a gradient of this step overflowed under the loss scale (the scaler then skips the step
        and backs off; not a guard verdict). Always False in fp32/bf16. Valid after backward."""
        ...

    def optimizer_step(self, lr: float, apply: bool = True) -> bool:
        """End the step: update with learning rate `lr` unless `apply` is False (a guard skip) or the gradients
        overflowed; drop the gradients either way. True when the weights were updated.

        A skipped step changes nothing a step would change: no weight or optimizer update, no routing-bias update
        (its expert counts are dropped), and after a guard skip the loss scale and its growth tracker stay put;
        after an overflow the scale backs off.
        """
        ...

    def extra_state(self) -> dict[str, Any]:
        """JSON-safe state a step mutates besides the weights and optimizer (the fp16 loss scale and its growth
        tracker), saved in every checkpoint's meta and restored by `load_extra_state` on resume and rollback."""
        ...

    def load_extra_state(self, state: dict[str, Any] | None) -> None:
        """Restore `extra_state()` (None or a missing entry: keep the current value, e.g. an fp32 checkpoint)."""
        ...

    def layer_grad_norms(self, total: float) -> list[float]:
        """This step's gradient norm per decoder block, then one entry for the rest (embeddings, final norm,
        output), as before clipping (`total`: clip_grad_norm's result). Valid between clip_grad_norm and
        optimizer_step; a collective on the parallel engine. For the spike triage (framework/train/triage.py)."""
        ...

    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean loss over `batch` (n_micro, B, T+1) without gradients (global mean over data ranks)."""
        ...

    def extra_metrics(self) -> dict[str, float]:
        """Engine-specific metrics for this step (loss scale, MoE load ...)."""
        ...

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes on this rank by kind and dtype (framework/parallel/memory.py); the trainer writes it
        once per start as a `memory` record (docs/METRICS.md)."""
        ...


def cross_entropy(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(0, 1))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


_BLOCK_PARAM = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # models/decoder.py's blocks, also under compile wrappers


def params_by_layer(parts: Iterable[nn.Module], n_layers: int) -> Iterator[tuple[int, nn.Parameter]]:
    """(layer index, parameter) of every parameter; n_layers for those outside the blocks."""
    for part in parts:
        for name, p in part.named_parameters():
            m = _BLOCK_PARAM.search(name)
            yield (int(m.group(1)) if m else n_layers), p


def unclipped(norms: list[float], total: float) -> list[float]:
    """Per-layer norms of clipped gradients scaled back to before clipping (clipping scales every layer alike)."""
    now = math.sqrt(sum(n * n for n in norms))
    return [n * total / now for n in norms] if now > 0 and math.isfinite(now) and math.isfinite(total) else norms
