"""`LocalEngine`: one process, one device — the reference every parallel layout is parity-tested against.

It implements the `Engine` protocol (framework/engine.py) that the loop talks to; the multi-rank engine beside
it (framework/train/parallel_engine.py) implements the same protocol over a model that
framework/parallel/parallelize.py parallelized.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from framework.engine import cross_entropy, params_by_layer, unclipped
from framework.numerics.precision import LossScaler, autocast, finish_step
from framework.numerics.transforms import Site, apply_model_transforms, model_transforms
from framework.parallel.memory import model_state_report
from framework.parallel.precision import grad_norms_by_bucket
from framework.train.config import TrainConfig
from framework.train.optim import build_optimizer
from framework.train.qk_clip import QKClip
from models.config import ModelConfig
from models.decoder import build_model
from models.documents import DocumentMasking, model_kwargs
from models.moe.step import discard_routing_counts, moe_metrics, set_aux_loss_scale, update_routing_bias
from models.mtp import mtp_metrics, set_mtp_loss_scale


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
        # The one list of model transforms (framework/numerics/transforms.py), at the point parallelize applies it.
        apply_model_transforms(self.model, model_transforms(train_cfg), Site(device_type=device.type))
        self.model_parts: list[nn.Module] = [self.model]
        self.optimizers: list[torch.optim.Optimizer] = [build_optimizer(self.model_parts, train_cfg, device)]
        self.dp_rank, self.dp_size = 0, 1
        self.scaler = LossScaler(train_cfg.precision == "fp16", init_scale=train_cfg.loss_scale_init,
                                 growth_interval=train_cfg.loss_scale_growth_interval)
        self._found_inf: bool | None = None  # after this step's unscale: whether a gradient overflowed
        self.is_moe = model_cfg.moe.enabled
        self.qk_clip = QKClip.build(self.model_parts, model_cfg, train_cfg)  # MuonClip (train.muon.qk_clip)

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.model_parts:
            yield from part.parameters()

    def forward_backward(self, batch: torch.Tensor) -> float:
        batch = batch.to(self.device, non_blocking=True)
        n_micro = batch.shape[0]
        total = torch.zeros((), device=self.device)
        if self.is_moe:  # MoE (docs/MOE.md): aux losses join the gradients via each layer's output, scaled as the loss
            set_aux_loss_scale(self.model_parts, self.scaler.scale / n_micro)
        mtp = {}
        if self.model.mtp is not None:  # multi-token prediction (models/mtp.py): its loss rides on the logits
            set_mtp_loss_scale(self.model_parts, self.scaler.scale / n_micro)
        for mb in batch:
            inputs, labels = mb[:, :-1], mb[:, 1:]
            if self.model.mtp is not None:
                mtp = {"mtp_labels": labels}
            with autocast(self.device, self.train_cfg.precision):
                logits = self.model(inputs, **model_kwargs(self.documents, inputs), **mtp)
            loss = cross_entropy(logits, labels) / n_micro
            self.scaler.scale_loss(loss).backward()
            total += loss.detach()
        return float(total)

    def _unscale(self) -> bool:
        if self._found_inf is None:  # once per step
            self._found_inf = self.scaler.unscale_(p.grad for p in self.parameters() if p.grad is not None)
        return self._found_inf

    def clip_grad_norm(self, max_norm: float) -> float:
        self._unscale()
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
        return float(norm)

    def layer_grad_norms(self, total: float) -> list[float]:
        n = self.model.cfg.n_layers
        norms = grad_norms_by_bucket(params_by_layer(self.model_parts, n), n + 1, 1, [], self.device)
        return unclipped(norms, total)

    def grads_overflowed(self) -> bool:
        return self.scaler.enabled and self._unscale()

    def optimizer_step(self, lr: float, apply: bool = True) -> bool:
        applied = finish_step(self.optimizers, self.scaler, lr, apply=apply, overflow=self.grads_overflowed())
        self._found_inf = None
        if self.qk_clip is not None:
            self.qk_clip.after_optimizer_step(applied)
        if self.is_moe:  # MoE (docs/MOE.md): auxiliary-loss-free balancing moves the routing bias after the step
            (update_routing_bias if applied else discard_routing_counts)(self.model_parts)
        return applied

    def extra_state(self) -> dict[str, Any]:
        sd = self.scaler.state_dict()
        return {"loss_scale": sd} if sd else {}

    def load_extra_state(self, state: dict[str, Any] | None) -> None:
        self.scaler.load_state_dict((state or {}).get("loss_scale"))

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        batch = batch.to(self.device)
        losses = []
        for mb in batch:
            with autocast(self.device, self.train_cfg.precision):
                logits = self.model(mb[:, :-1], **model_kwargs(self.documents, mb[:, :-1]))
            losses.append(cross_entropy(logits, mb[:, 1:]))
        return float(torch.stack(losses).mean())

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes of this process by kind and dtype (framework/parallel/memory.py)."""
        return model_state_report(self.model_parts, self.optimizers)

    def extra_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"loss_scale": self.scaler.scale} if self.scaler.enabled else {}
        out.update(mtp_metrics(self.model_parts))
        if self.is_moe:  # MoE (docs/MOE.md): per-layer load, drops, aux and z losses of the step
            out.update(moe_metrics(self.model_parts))
        return out
