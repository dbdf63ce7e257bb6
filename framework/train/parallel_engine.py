"""The parallel engine: TP -> (EP) -> activation checkpointing -> FSDP -> pipeline stages, behind `Engine`.

    engine = build_parallel_engine(cfg, device)   # every rank; the default process group is initialized

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

from framework.engine import DTYPES, autocast, cross_entropy
from framework.errors import ParallelismError
from framework.parallel.comm import CommLogger, mesh_axes
from framework.parallel.compile import compile_blocks
from framework.parallel.config import V_SCHEDULES, ParallelConfig, min_micro_batches, schedule_micro_batch_problem
from framework.parallel.context import ContextParallel
from framework.parallel.expert import MoEParallel
from framework.parallel.memory import model_state_report, unsharded_bytes
from framework.parallel.mesh import AXES, ParallelDims
from framework.parallel.offload import io_metrics, offload_optimizers
from framework.parallel.pipeline import build_schedule, cut_stage, local_stages, run_schedule
from framework.parallel.precision import (
    LossScaler,
    global_grad_norm,
    local_grad,
    resolve_partial_grads,
    scale_grads,
)
from framework.parallel.recompute import apply_recompute
from framework.parallel.tensor import apply_tensor_parallel
from framework.parallel.zero import ReplicatedGradSync, apply_fsdp, fsdp_mesh, fsdp_mp_policy, set_micro_batch_sync
from framework.train.config import TrainConfig
from framework.train.optim import build_optimizer
from models.config import ModelConfig
from models.decoder import Decoder
from models.documents import DocumentMasking, model_kwargs


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
        self.documents = documents
        coord = dict(zip(AXES, mesh.get_coordinate() or ()))
        self.dp_rank = coord["dp_replicate"] * dims.dp_shard + coord["dp_shard"]
        self.dp_size = dims.dp_size
        self.pp_rank = coord["pp"]
        self.n_micro = micro_batches(dims, train_cfg, pcfg.pp_schedule)
        self.use_loss_parallel = dims.tp > 1 and pcfg.loss_parallel
        self.scaler = LossScaler(train_cfg.precision == "fp16", init_scale=train_cfg.loss_scale_init,
                                 growth_interval=train_cfg.loss_scale_growth_interval)
        self.tied_copy: torch.Tensor | None = None  # the last stage's copy of a tied embedding
        self.moe = MoEParallel(model_cfg, pcfg, dims, mesh)  # MoE (issue 5); every call a no-op for dense models
        # Context parallelism (issue 16): each rank keeps its 2 load-balanced chunks of every sequence
        self.context = ContextParallel(mesh["cp"].get_group(), DTYPES[train_cfg.precision]) if dims.cp > 1 else None
        self._build_parts()
        self.optimizers: list[torch.optim.Optimizer] = [build_optimizer([p], train_cfg, device)
                                                        for p in self.model_parts]
        self._fix_tied_decay()
        self.optimizers = offload_optimizers(  # ZeRO-Infinity (issue 19): AdamW states on local NVMe
            self.optimizers, pcfg.nvme_offload, device, [mesh[a].get_group() for a in AXES if dims.size(a) > 1])
        self.replica_sync: ReplicatedGradSync | None = None
        if dims.fsdp_size == 1 and dims.dp_replicate > 1:
            self.replica_sync = ReplicatedGradSync(list(self.parameters()), mesh["dp_replicate"].get_group(),
                                                   dims.dp_replicate)
        self.groups = [mesh[a].get_group() for a in AXES if dims.size(a) > 1]
        self._schedules: dict[int, Any] = {}
        self._found_inf = self._unscaled = False
        self.comm = CommLogger(mesh_axes(mesh, AXES)) if pcfg.comm_log else None

    def _comm(self) -> contextlib.AbstractContextManager[Any]:
        return self.comm.active() if self.comm is not None else contextlib.nullcontext()

    # --- construction ---------------------------------------------------------------------------------------
    def _build_parts(self) -> None:
        self._fsdp_mesh = fsdp_mesh(self.mesh, self.dims)
        with torch.device("meta"):
            whole = Decoder(self.model_cfg)
        if self.dims.pp > 1:
            self.stage_ids, layers, self.n_stages = local_stages(self.pcfg, self.pp_rank, self.model_cfg.n_layers)
            parts = [cut_stage(whole, s, layers[s], self.n_stages) for s in self.stage_ids]
        else:
            self.stage_ids, self.n_stages, parts = [0], 1, [whole]
        for part in parts:
            self._parallelize(part)
        self.model_parts: list[nn.Module] = list(parts)
        if self.model_cfg.tied_embeddings and self.dims.pp > 1:
            self._tie_setup(parts)

    def _parallelize(self, part: Decoder) -> None:
        dims, pcfg = self.dims, self.pcfg
        if dims.tp > 1:
            apply_tensor_parallel(part, self.mesh["tp"], sequence_parallel=pcfg.sequence_parallel,
                                  loss_parallel=pcfg.loss_parallel)
        self.moe.parallelize(part)  # MoE (issue 5): experts over ep, routing on the tp sequence shards
        if self.context is not None:
            self.context.install(part)
        part.to_empty(device=self.device)
        if self.model_cfg.tied_embeddings and part.tok_embeddings is not None and part.output is not None:
            # to_empty gives each module its own storage: without this a pp=1 run of a tied model trains untied.
            part.output.weight = part.tok_embeddings.weight
        part.init_weights(self.train_cfg.seed)  # per-FQN seeds: bitwise the 1-process values, any layout
        apply_recompute(part.layers, pcfg.recompute, pcfg.recompute_every)
        if self.train_cfg.compile:  # after TP and recompute, before FSDP (whose hooks stay outside the graphs)
            compile_blocks(part.layers, self.train_cfg.compile_backend, tensor_parallel=dims.tp > 1)
        mp_policy = fsdp_mp_policy(pcfg, self.train_cfg.precision)
        # MoE (issue 5): experts FSDP-sharded over the edp ranks (before FSDP wraps their blocks), or hand-synced
        self.moe.shard(part, mp_policy=mp_policy)
        if self._fsdp_mesh is not None:
            apply_fsdp(part, self._fsdp_mesh, pcfg, mp_policy=mp_policy, pipelined=dims.pp > 1)

    def _tie_setup(self, parts: list[Decoder]) -> None:
        last = self.n_stages - 1
        if last in self.stage_ids:
            head = parts[self.stage_ids.index(last)].output
            assert head is not None
            self.tied_copy = head.weight
        # A V schedule puts stage 0 and the last stage on pp rank 0; otherwise they sit on pp ranks 0 and pp-1
        # (looped schedules too), which swap their gradient pieces point-to-point after backward.
        self._tie_local = self.pcfg.pp_schedule in V_SCHEDULES
        pp_ranks = self.mesh["pp"].mesh.flatten().tolist()
        self._tie_peer = pp_ranks[-1] if self.pp_rank == 0 else pp_ranks[0]

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

    def _sync_tied(self) -> None:
        emb: torch.Tensor | None = None
        if 0 in self.stage_ids:
            tok = self.model_parts[self.stage_ids.index(0)].tok_embeddings
            assert isinstance(tok, nn.Embedding)
            emb = tok.weight
        if self._tie_local:
            if emb is None or self.tied_copy is None:
                return  # a middle rank of the V
            g_emb, _ = local_grad(emb)
            g_out, _ = local_grad(self.tied_copy)
            g_emb.add_(g_out)
            g_out.copy_(g_emb)
            return
        param = emb if emb is not None else self.tied_copy
        if param is None:
            return  # a middle pp rank holds neither copy
        g, _ = local_grad(param)
        other = torch.empty_like(g)
        group = self.mesh["pp"].get_group()
        ops = [dist.P2POp(dist.isend, g, self._tie_peer, group), dist.P2POp(dist.irecv, other, self._tie_peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        g.add_(other)  # a + b == b + a bitwise: both copies stay identical

    def _after_backward(self) -> None:
        self.moe.after_backward(self.model_parts)  # MoE (issue 5): expert gradients over edp without FSDP
        if self.dims.tp > 1:
            resolve_partial_grads(self.parameters())
        if self.replica_sync is not None:
            self.replica_sync()
        if self.model_cfg.tied_embeddings and self.dims.pp > 1:
            self._sync_tied()

    # --- the Engine interface -------------------------------------------------------------------------------
    def _split(self, rows_BT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(inputs, labels, Decoder keyword arguments) of full rows: this rank's cp chunks under cp."""
        if self.context is not None:
            return self.context.shard(rows_BT1, self.documents)
        inputs = rows_BT1[:, :-1]
        return inputs, rows_BT1[:, 1:], model_kwargs(self.documents, inputs)

    def _loss_ctx(self) -> contextlib.AbstractContextManager[None]:
        return loss_parallel() if self.use_loss_parallel else contextlib.nullcontext()

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, labels) * self.scaler.scale

    def _schedule(self, n_micro: int) -> Any:
        if n_micro not in self._schedules:
            self._schedules[n_micro] = build_schedule(
                self.model_parts, self.stage_ids, self.n_stages, self.mesh["pp"].get_group(), self.device,
                self.pcfg.pp_schedule, n_micro, self._loss_fn)
        return self._schedules[n_micro]

    def _pipeline(self, batch: torch.Tensor, train: bool) -> torch.Tensor | None:
        flat = batch.reshape(-1, batch.shape[-1])
        need = min_micro_batches(self.pcfg.pp_schedule, self.dims.pp)
        if batch.shape[0] < need and flat.shape[0] % need == 0:
            # Evaluation hands over one micro-batch: split its rows so every stage gets work (equal-length
            # sequences, so the mean of the chunk means is the batch mean).
            batch = flat.reshape(need, -1, flat.shape[-1])
        inputs, labels, kwargs = self._split(flat)
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
        # MoE (issue 5): the aux losses' gradient per forward; the pipeline schedule divides by n_micro itself
        self.moe.before_step(self.model_parts, self.scaler.scale / (1 if self.dims.pp > 1 else batch.shape[0]))
        if self.dims.pp > 1:
            local = self._pipeline(batch, train=True)
        else:
            n = batch.shape[0]
            local = torch.zeros((), device=self.device)
            for i, mb in enumerate(batch):
                for part in self.model_parts:
                    set_micro_batch_sync(part, self.pcfg.zero_stage, i == n - 1)
                inputs, labels, kwargs = self._split(mb)
                with autocast(self.device, self.train_cfg.precision):
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
        scale_grads(params, 1.0 / self.scaler.scale)
        counted = [p for p in params if p is not self.tied_copy]  # a tied weight counts once (first stage)
        norm = float(global_grad_norm(counted, self.dims.world_size // self.dims.pp, self.groups, self.device))
        self._found_inf = not math.isfinite(norm)
        self._unscaled = True
        if max_norm > 0 and not self._found_inf:
            scale_grads(params, min(1.0, max_norm / (norm + 1e-6)))
        return norm

    def grads_overflowed(self) -> bool:
        """fp16: a gradient overflowed somewhere in the layout (the global norm is not finite); see `Engine`."""
        if self.scaler.enabled and not self._unscaled:
            self._clip_grad_norm(0.0)  # unscale and check, measuring only
        return self.scaler.enabled and self._found_inf

    def optimizer_step(self, lr: float, apply: bool = True) -> bool:
        with self._comm():
            return self._optimizer_step(lr, apply)

    def _optimizer_step(self, lr: float, apply: bool) -> bool:
        overflow = self.grads_overflowed()
        applied = apply and not overflow
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
            if applied:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if applied or overflow:
            self.scaler.update(overflow)  # a guard skip leaves the scale and its growth tracker alone
        # MoE (issue 5): routing-bias update from this step's counts, or the counts dropped with the step
        self.moe.after_optimizer_step(self.model_parts, applied)
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
        out.update(self.moe.metrics(self.model_parts))  # MoE (issue 5): load, drops, aux/z losses per layer
        out.update(io_metrics(self.optimizers))  # NVMe offload (issue 19): cumulative bytes read / written
        if self.comm is not None:
            out.update(self.comm.summary())
            self.comm.reset()
        return out

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes on this rank by kind and dtype (framework/parallel/memory.py)."""
        report = model_state_report(self.model_parts, self.optimizers)
        report["params_unsharded"], report["grads_unsharded"] = unsharded_bytes(self.model_parts)
        return report


def build_parallel_engine(cfg: Any, device: torch.device, mesh: DeviceMesh | None = None,
                          documents: DocumentMasking | None = None) -> ParallelEngine:
    """The engine for `cfg` (a framework.config.Config) on the whole world, or on `mesh` when given."""
    world = mesh.size() if mesh is not None else dist.get_world_size()
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model)
    if mesh is None:
        mesh = dims.build_mesh(device.type)
    return ParallelEngine(cfg.model, cfg.train, cfg.parallel, device, dims, mesh, documents)
