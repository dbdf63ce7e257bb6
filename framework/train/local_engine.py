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
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from framework.parallel.compile import compile_blocks
from framework.train.config import TrainConfig
from framework.train.optim import build_optimizer
from models.config import ModelConfig
from models.decoder import build_model
from models.documents import DocumentMasking, model_kwargs
from models.moe.step import discard_routing_counts, moe_metrics, set_aux_loss_scale, update_routing_bias

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
        self.scaler = torch.amp.GradScaler(device.type, init_scale=train_cfg.loss_scale_init,
                                           growth_interval=train_cfg.loss_scale_growth_interval,
                                           enabled=train_cfg.precision == "fp16")
        self._unscaled = False
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

    def _unscale(self) -> None:
        if not self._unscaled:  # once per step: GradScaler refuses a second unscale_ before update()
            for opt in self.optimizers:
                self.scaler.unscale_(opt)
            self._unscaled = True

    def clip_grad_norm(self, max_norm: float) -> float:
        self._unscale()
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
        return float(norm)

    def grads_overflowed(self) -> bool:
        if not self.scaler.is_enabled():
            return False
        self._unscale()
        # The inf/NaN flags unscale_ recorded: the very check GradScaler.step() skips on.
        return any(bool(flag.item()) for opt in self.optimizers
                   for flag in self.scaler._found_inf_per_device(opt).values())

    def optimizer_step(self, lr: float, apply: bool = True) -> bool:
        overflow = self.grads_overflowed()
        applied = apply and not overflow
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
            if applied:
                self.scaler.step(opt)
            opt.zero_grad(set_to_none=True)
        if applied or overflow:
            self.scaler.update()  # growth count on a clean step, backoff on an overflow
        else:
            self.scaler.update(new_scale=self.scaler.get_scale())  # a guard skip: scale and growth tracker stay
        self._unscaled = False
        if self.is_moe:  # MoE (issue 5): auxiliary-loss-free balancing moves the routing bias after the step
            (update_routing_bias if applied else discard_routing_counts)(self.model_parts)
        return applied

    def extra_state(self) -> dict[str, Any]:
        sd = self.scaler.state_dict()
        return {"loss_scale": {"scale": sd["scale"], "growth_tracker": sd["_growth_tracker"]}} if sd else {}

    def load_extra_state(self, state: dict[str, Any] | None) -> None:
        saved = (state or {}).get("loss_scale")
        if saved and self.scaler.is_enabled():
            sd = self.scaler.state_dict()
            sd.update(scale=float(saved["scale"]), _growth_tracker=int(saved["growth_tracker"]))
            self.scaler.load_state_dict(sd)

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
