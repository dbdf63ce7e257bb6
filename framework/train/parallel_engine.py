"""The parallel step engine: runs the model framework/parallel/parallelize.py built, behind `Engine`.

    engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, device)   # every rank, process group up

It owns what a step needs beyond the model: the optimizers (one per part, optionally on NVMe), the loss
scaler, the pipeline schedules (one per micro-batch count, built at first use), the gradient reductions after
backward and the global clipping.

The loop hands each rank its data-parallel replica's micro-batches (n_micro, B, T+1); ranks of one replica
(its tp, cp and pp ranks) get the same batch, and cp ranks keep their own load-balanced chunks of it
(framework/parallel/context.py). The returned loss is the global mean over every data rank, on every rank.
Parity with the single-process `LocalEngine` is the contract (tests/parallel/test_parity.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from framework.base.errors import ParallelismError
from framework.engine import cross_entropy, params_by_layer, unclipped
from framework.numerics.precision import LossScaler, autocast, finish_step
from framework.numerics.transforms import model_transforms
from framework.parallel.comm import CommLogger, layout_axes
from framework.parallel.config import ParallelConfig
from framework.parallel.memory import model_state_report, unsharded_bytes
from framework.parallel.mesh import AXES, ParallelDims, dp_tp_group, groups_created
from framework.parallel.offload import io_metrics, offload_optimizers
from framework.parallel.parallelize import parallelize
from framework.parallel.pipeline import build_schedule, run_schedule
from framework.parallel.pipeline_schedules import min_micro_batches, schedule_micro_batch_problem
from framework.parallel.precision import (
    clip_factor,
    global_grad_norm,
    grad_norms_by_bucket,
    resolve_partial_grads,
    scale_grads,
)
from framework.parallel.zero import set_micro_batch_sync
from framework.train.config import TrainConfig
from framework.train.muon_overlap import BackwardExchange, overlap_exchange
from framework.train.optim import build_optimizer
from framework.train.qk_clip import QKClip
from models.config import ModelConfig
from models.documents import DocumentMasking, model_kwargs
from models.mtp import mtp_label_stack, mtp_metrics, set_mtp_loss_scale


def micro_batches(dims: ParallelDims, train_cfg: TrainConfig, schedule: str = "1F1B") -> int:
    """Micro-batches per step on one data rank (= pipeline micro-batches); ParallelismError when they do not fit."""
    if train_cfg.global_batch_size % (train_cfg.micro_batch_size * dims.dp_size):
        raise ParallelismError(
            f"train.global_batch_size={train_cfg.global_batch_size} must be a multiple of micro_batch_size x "
            f"data-parallel size = {train_cfg.micro_batch_size} x {dims.dp_size}; change one of them")
    n_micro = train_cfg.global_batch_size // (train_cfg.micro_batch_size * dims.dp_size)
    if dims.pp > 1:
        problem = schedule_micro_batch_problem(schedule, dims.pp, n_micro)
        if problem:
            raise ParallelismError(
                f"pipeline micro-batches = global_batch_size / (micro_batch_size x dp) = "
                f"{train_cfg.global_batch_size} / ({train_cfg.micro_batch_size} x {dims.dp_size}) = {n_micro}, but "
                f"{problem}; change train.global_batch_size or train.micro_batch_size")
    return n_micro


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class ParallelEngine:
    """One rank of a layout described by `dims` on `mesh` (a 5-axis mesh over the layout's ranks).

    With `documents`, every rank derives the document ids from its own copy of the replica's full-sequence tokens
    (before sequence-parallel sharding); pipeline stages receive them as schedule keyword arguments, split into
    micro-batches like the inputs, so they cost no communication.
    """

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, pcfg: ParallelConfig, device: torch.device,
                 dims: ParallelDims, mesh: DeviceMesh, documents: DocumentMasking | None = None) -> None:
        self.model_cfg, self.train_cfg, self.pcfg, self.dims, self.mesh = model_cfg, train_cfg, pcfg, dims, mesh
        self.device = device
        groups_before = groups_created()
        self.documents = documents
        coord = dict(zip(AXES, mesh.get_coordinate() or ()))
        self.dp_rank = coord["dp_replicate"] * dims.dp_shard + coord["dp_shard"]
        self.dp_size = dims.dp_size
        self.pp_rank = coord["pp"]
        self.n_micro = micro_batches(dims, train_cfg, pcfg.pp_schedule)
        self.use_loss_parallel = dims.tp > 1 and pcfg.loss_parallel
        self.scaler = LossScaler(train_cfg.precision == "fp16", init_scale=train_cfg.loss_scale_init,
                                 growth_interval=train_cfg.loss_scale_growth_interval)
        pm = parallelize(model_cfg, pcfg, dims, mesh, device, seed=train_cfg.seed, precision=train_cfg.precision,
                         transforms=model_transforms(train_cfg))
        self.model_parts: list[nn.Module] = pm.parts
        self.stage_ids, self.n_stages = pm.stage_ids, pm.n_stages
        self.moe, self.context, self.tied, self.replica_sync = pm.moe, pm.context, pm.tied, pm.replica_sync
        self.tied_copy = self.tied.head if self.tied is not None else None  # the last stage's copy of a tied embedding
        self.optimizers: list[torch.optim.Optimizer] = [build_optimizer([p], train_cfg, device)
                                                        for p in self.model_parts]
        # MuonClip (train.muon.qk_clip): this tp rank's heads start at tp_rank x H/tp; maxima meet over every axis
        self.qk_clip = QKClip.build(self.model_parts, model_cfg, train_cfg, coord["tp"] * model_cfg.n_heads // dims.tp,
                                    [mesh[a].get_group() for a in AXES if dims.size(a) > 1])
        self._fix_tied_decay()
        # Muon's owner exchange from backward hooks where the layout allows (framework/train/muon_overlap.py)
        self.muon_exchange = overlap_exchange(self.optimizers, self.model_parts, train_cfg, pcfg, dims, model_cfg,
                                              self.replica_sync, dp_tp_group(mesh))
        self.optimizers = offload_optimizers(  # ZeRO-Infinity (docs/PARALLELISM.md): AdamW states on local NVMe
            self.optimizers, pcfg.nvme_offload, device, [mesh[a].get_group() for a in AXES if dims.size(a) > 1])
        self.groups = [mesh[a].get_group() for a in AXES if dims.size(a) > 1]
        self._schedules: dict[int, Any] = {}
        self._found_inf = self._unscaled = False
        self.comm = CommLogger(layout_axes(mesh, self.model_parts)) if pcfg.comm_log else None
        made = groups_created() - groups_before
        if made and mesh.size() != dist.get_world_size():
            raise ParallelismError(
                f"building the engine on a sub-world mesh ({mesh.size()} of {dist.get_world_size()} ranks) created "
                f"{made} process group(s) on its ranks only, which desynchronizes group names with the other ranks "
                f"(a collective deadlock or cross-group sums; ParallelDims.build_mesh); create them in build_mesh")

    def _comm(self) -> contextlib.AbstractContextManager[Any]:
        return self.comm.active() if self.comm is not None else contextlib.nullcontext()

    def _fix_tied_decay(self) -> None:
        """The head's copy of a tied embedding follows the embedding's (no) weight decay, as in the 1-process run."""
        if self.tied_copy is None:
            return
        for opt in self.optimizers:
            decay, no_decay = opt.param_groups[0], opt.param_groups[1]
            if any(p is self.tied_copy for p in decay["params"]):
                decay["params"] = [p for p in decay["params"] if p is not self.tied_copy]
                no_decay["params"].append(self.tied_copy)

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.model_parts:
            yield from part.parameters()

    # --- reductions -----------------------------------------------------------------------------------------
    def _sum_over_layout(self, t: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            dist.all_reduce(t, group=group)
        return t

    def _global_mean_loss(self, local_mean: torch.Tensor | None) -> float:
        """Loss of the last stage's ranks averaged over data ranks (tp copies divide out), on every rank."""
        t = torch.zeros((), dtype=torch.float64, device=self.device)
        if local_mean is not None:
            t += local_mean.detach().double()
        self._sum_over_layout(t)
        return float(t) / (self.dims.world_size // self.dims.pp)

    def _after_backward(self) -> None:
        if self.replica_sync is not None:  # first: the buckets hold the gradients as backward left them
            self.replica_sync()
        self.moe.after_backward(self.model_parts)  # MoE (docs/MOE.md): expert gradients over edp without FSDP
        if self.dims.tp > 1:
            resolve_partial_grads(self.parameters())
        if self.tied is not None:
            self.tied.sync_grads()

    # --- the Engine interface -------------------------------------------------------------------------------
    def _split(self, rows_BT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(inputs, labels, Decoder keyword arguments) of full rows: this rank's cp chunks under cp."""
        if self.context is not None:
            return self.context.shard(rows_BT1, self.documents)
        inputs = rows_BT1[:, :-1]
        return inputs, rows_BT1[:, 1:], model_kwargs(self.documents, inputs)

    def _mtp_labels(self, rows_BT1: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """What the MTP modules read: the labels, or under cp the whole rows' shifted labels cut as the inputs
        (their shifts reach past a rank's chunks; models/mtp.py)."""
        if self.context is None:
            return labels
        return self.context.local(mtp_label_stack(rows_BT1[:, 1:], self.model_cfg.mtp_depth))

    def _loss_ctx(self) -> contextlib.AbstractContextManager[None]:
        return loss_parallel() if self.use_loss_parallel else contextlib.nullcontext()

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, labels) * self.scaler.scale

    def _schedule(self, n_micro: int) -> Any:
        if n_micro not in self._schedules:
            self._schedules[n_micro] = build_schedule(
                self.model_parts, self.stage_ids, self.n_stages, self.mesh["pp"].get_group(), self.device,
                self.pcfg.pp_schedule, n_micro, self._loss_fn,  # (no tp-only exchange under pp: overlap_problem)
                watcher=self.muon_exchange if isinstance(self.muon_exchange, BackwardExchange) else None)
        return self._schedules[n_micro]

    def _pipeline(self, batch: torch.Tensor, train: bool) -> torch.Tensor | None:
        flat = batch.reshape(-1, batch.shape[-1])
        need = min_micro_batches(self.pcfg.pp_schedule, self.dims.pp)
        if batch.shape[0] < need and flat.shape[0] % need == 0:
            # Evaluation hands over one micro-batch: split its rows so every stage gets work (equal-length
            # sequences, so the mean of the chunk means is the batch mean).
            batch = flat.reshape(need, -1, flat.shape[-1])
        inputs, labels, kwargs = self._split(flat)
        if self.model_cfg.mtp_depth and train:  # the last stage's MTP modules (models/mtp.py) read the labels
            kwargs["mtp_labels"] = self._mtp_labels(flat, labels)
        with autocast(self.device, self.train_cfg.precision), self._loss_ctx():
            losses = run_schedule(self._schedule(batch.shape[0]), self.stage_ids, self.n_stages, inputs, labels,
                                  train=train, model_kwargs=kwargs)
        if not losses:
            return None
        return torch.stack([_scalar(x).detach().float() for x in losses]).mean() / self.scaler.scale

    def forward_backward(self, batch: torch.Tensor) -> float:
        with self._comm():
            return self._forward_backward(batch)

    def _forward_backward(self, batch: torch.Tensor) -> float:
        batch = batch.to(self.device, non_blocking=True)
        self._found_inf = False
        # MoE (docs/MOE.md): the aux losses' gradient per forward; the pipeline schedule divides by n_micro itself
        self.moe.before_step(self.model_parts, self.scaler.scale / (1 if self.dims.pp > 1 else batch.shape[0]))
        # MTP (models/mtp.py), where configured: the same gradient as the main loss's per forward
        set_mtp_loss_scale(self.model_parts, self.scaler.scale / (1 if self.dims.pp > 1 else batch.shape[0]))
        if self.dims.pp > 1:
            local = self._pipeline(batch, train=True)
        else:
            n = batch.shape[0]
            local = torch.zeros((), device=self.device)
            for i, mb in enumerate(batch):
                for part in self.model_parts:
                    set_micro_batch_sync(part, self.pcfg.zero_stage, i == n - 1)
                if self.replica_sync is not None:
                    self.replica_sync.arm(i == n - 1)  # DDP buckets launch from the last backward's hooks
                if self.muon_exchange is not None:
                    self.muon_exchange.arm(i == n - 1)  # so do Muon's owner exchanges
                inputs, labels, kwargs = self._split(mb)
                forward_ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                if self.model_cfg.mtp_depth:  # its cross-entropy on vocab-parallel logits needs the loss context
                    kwargs, forward_ctx = {**kwargs, "mtp_labels": self._mtp_labels(mb, labels)}, self._loss_ctx()
                with autocast(self.device, self.train_cfg.precision), forward_ctx:
                    logits = self.model_parts[0](inputs, **kwargs)
                with self._loss_ctx():
                    loss = cross_entropy(logits, labels) / n
                    (loss * self.scaler.scale).backward()
                local += _scalar(loss.detach())
        self._after_backward()
        return self._global_mean_loss(local)

    def clip_grad_norm(self, max_norm: float) -> float:
        with self._comm():
            return self._clip_grad_norm(max_norm)

    def _clip_grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.parameters() if p.grad is not None]
        self._scale_grads(params, 1.0 / self.scaler.scale)
        counted = [p for p in params if p is not self.tied_copy]  # a tied weight counts once (first stage)
        norm = float(global_grad_norm(counted, self.dims.world_size // self.dims.pp, self.groups, self.device))
        self._found_inf = not math.isfinite(norm)
        self._unscaled = True
        if max_norm > 0 and not self._found_inf:
            self._scale_grads(params, clip_factor(norm, max_norm))
        return norm

    def _scale_grads(self, params: list[nn.Parameter], factor: float) -> None:
        scale_grads(params, factor)
        if self.muon_exchange is not None:  # the owners hold raw gradient pieces: they repeat the factor
            for opt in self.muon_exchange.optimizers:
                opt.grads_scaled(factor)

    def layer_grad_norms(self, total: float) -> list[float]:
        n = self.model_cfg.n_layers
        counted = ((i, p) for i, p in params_by_layer(self.model_parts, n) if p is not self.tied_copy)
        copies = self.dims.world_size // self.dims.pp
        return unclipped(grad_norms_by_bucket(counted, n + 1, copies, self.groups, self.device), total)

    def grads_overflowed(self) -> bool:
        """fp16: a gradient overflowed somewhere in the layout (the global norm is not finite); see `Engine`."""
        if self.scaler.enabled and not self._unscaled:
            self._clip_grad_norm(0.0)  # unscale and check, measuring only
        return self.scaler.enabled and self._found_inf

    def optimizer_step(self, lr: float, apply: bool = True) -> bool:
        with self._comm():
            return self._optimizer_step(lr, apply)

    def _optimizer_step(self, lr: float, apply: bool) -> bool:
        applied = finish_step(self.optimizers, self.scaler, lr, apply=apply, overflow=self.grads_overflowed())
        # MoE (docs/MOE.md): routing-bias update from this step's counts, or the counts dropped with the step
        self.moe.after_optimizer_step(self.model_parts, applied)
        if self.qk_clip is not None:
            self.qk_clip.after_optimizer_step(applied)
        self._found_inf = self._unscaled = False
        return applied

    def extra_state(self) -> dict[str, Any]:
        sd = self.scaler.state_dict()
        return {"loss_scale": sd} if sd else {}

    def load_extra_state(self, state: dict[str, Any] | None) -> None:
        self.scaler.load_state_dict((state or {}).get("loss_scale"))

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        batch = batch.to(self.device)
        if self.dims.pp > 1:
            return self._global_mean_loss(self._pipeline(batch, train=False))
        losses = []
        for mb in batch:
            inputs, labels, kwargs = self._split(mb)
            with autocast(self.device, self.train_cfg.precision):
                logits = self.model_parts[0](inputs, **kwargs)
            with self._loss_ctx():
                losses.append(_scalar(cross_entropy(logits, labels)))
        return self._global_mean_loss(torch.stack(losses).mean())

    def extra_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"loss_scale": self.scaler.scale} if self.scaler.enabled else {}
        out.update(self.moe.metrics(self.model_parts))  # MoE (docs/MOE.md): load, drops, aux/z losses per layer
        out.update(self._mtp_metrics())
        out.update(io_metrics(self.optimizers))  # NVMe offload (docs/PARALLELISM.md): cumulative bytes read / written
        if self.comm is not None:
            out.update(self.comm.summary())
            self.comm.reset()
        return out

    def _mtp_metrics(self) -> dict[str, float]:
        """`mtp/loss_k` averaged over the data ranks (tp copies divide out, as the main loss)."""
        if not self.model_cfg.mtp_depth:
            return {}
        mine = mtp_metrics(self.model_parts)
        t = torch.tensor([mine[f"mtp/loss_{k}"] for k in range(1, self.model_cfg.mtp_depth + 1)], dtype=torch.float64,
                         device=self.device) if mine else torch.zeros(self.model_cfg.mtp_depth, dtype=torch.float64)
        self._sum_over_layout(t)
        return {f"mtp/loss_{k + 1}": float(v) / (self.dims.world_size // self.dims.pp) for k, v in enumerate(t)}

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes on this rank by kind and dtype (framework/parallel/memory.py)."""
        report = model_state_report(self.model_parts, self.optimizers)
        report["params_unsharded"], report["grads_unsharded"] = unsharded_bytes(self.model_parts)
        return report


def build_parallel_engine(model_cfg: ModelConfig, train_cfg: TrainConfig, pcfg: ParallelConfig, device: torch.device,
                          mesh: DeviceMesh | None = None, documents: DocumentMasking | None = None) -> ParallelEngine:
    """The engine for the layout `pcfg` on the whole world, or on `mesh` when given."""
    world = mesh.size() if mesh is not None else dist.get_world_size()
    dims = ParallelDims.from_config(pcfg, world, model_cfg)
    if mesh is None:
        mesh = dims.build_mesh(device.type, experts=model_cfg.moe.enabled)
    return ParallelEngine(model_cfg, train_cfg, pcfg, device, dims, mesh, documents)
