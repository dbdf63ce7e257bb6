"""The seam between the training loop and parallelism.

The loop (framework/train/trainer.py) only talks to an `Engine`: it hands over this rank's micro-batches for
one optimizer step and gets back the global mean loss. `LocalEngine` is the single-process engine — the
reference every parallel layout is parity-tested against; framework/parallel builds the multi-rank one with
the same interface.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from framework.train.compile import compile_blocks
from framework.train.config import TrainConfig
from framework.train.optim import build_optimizer
from models.config import ModelConfig
from models.decoder import build_model
from models.documents import DocumentMasking, model_kwargs
from models.moe.step import moe_metrics, set_aux_loss_scale, update_routing_bias

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    def optimizer_step(self, lr: float) -> bool:
        """Apply the update with learning rate `lr`; False when it was skipped (fp16 overflow)."""
        ...

    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean loss over `batch` (n_micro, B, T+1) without gradients (global mean over data ranks)."""
        ...

    def extra_metrics(self) -> dict[str, float]:
        """Engine-specific metrics for this step (loss scale, MoE load ...)."""
        ...


def cross_entropy(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(0, 1))


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[precision])


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LocalEngine:
    """One process, one device: gradient accumulation over micro-batches, AdamW, optional bf16/fp16 autocast.

    `documents` (data.document_mask / data.reset_position_ids) keeps attention within each packed document.
    """

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, device: torch.device,
                 documents: DocumentMasking | None = None) -> None:
        self.device = device
        self.train_cfg = train_cfg
        self.documents = documents
        self.model = build_model(model_cfg, seed=train_cfg.seed, device=device)
        if train_cfg.compile:
            compile_blocks(self.model.layers, train_cfg.compile_backend)
        self.model_parts: list[nn.Module] = [self.model]
        self.optimizers: list[torch.optim.Optimizer] = [build_optimizer(self.model_parts, train_cfg, device)]
        self.dp_rank, self.dp_size = 0, 1
        self.scaler = torch.amp.GradScaler(device.type, enabled=train_cfg.precision == "fp16")
        self.is_moe = model_cfg.moe.enabled

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.model_parts:
            yield from part.parameters()

    def forward_backward(self, batch: torch.Tensor) -> float:
        batch = batch.to(self.device, non_blocking=True)
        n_micro = batch.shape[0]
        total = torch.zeros((), device=self.device)
        if self.is_moe:  # MoE (issue 5): aux losses join the gradients through each layer's output, scaled as the loss
            loss_scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
            set_aux_loss_scale(self.model_parts, loss_scale / n_micro)
        for mb in batch:
            inputs, labels = mb[:, :-1], mb[:, 1:]
            with autocast(self.device, self.train_cfg.precision):
                logits = self.model(inputs, **model_kwargs(self.documents, inputs))
            loss = cross_entropy(logits, labels) / n_micro
            self.scaler.scale(loss).backward()
            total += loss.detach()
        return float(total)

    def clip_grad_norm(self, max_norm: float) -> float:
        for opt in self.optimizers:
            self.scaler.unscale_(opt)
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
        return float(norm)

    def optimizer_step(self, lr: float) -> bool:
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
            self.scaler.step(opt)
            opt.zero_grad(set_to_none=True)
        self.scaler.update()
        if self.is_moe:  # MoE (issue 5): auxiliary-loss-free balancing moves the routing bias after the step
            update_routing_bias(self.model_parts)
        return not (self.scaler.is_enabled() and self.scaler.get_scale() < scale_before)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        batch = batch.to(self.device)
        losses = []
        for mb in batch:
            with autocast(self.device, self.train_cfg.precision):
                logits = self.model(mb[:, :-1], **model_kwargs(self.documents, mb[:, :-1]))
            losses.append(cross_entropy(logits, mb[:, 1:]))
        return float(torch.stack(losses).mean())

    def extra_metrics(self) -> dict[str, float]:
        out = {"loss_scale": self.scaler.get_scale()} if self.scaler.is_enabled() else {}
        if self.is_moe:  # MoE (issue 5): per-layer load, drops, aux and z losses of the step
            out.update(moe_metrics(self.model_parts))
        return out
