"""The one parallelize recipe: how this rank's part of the model is built under a layout, top to bottom.

    pm = parallelize(model_cfg, pcfg, dims, mesh, device, seed=train.seed, precision=train.precision)
    pm.parts          # this rank's pipeline stages (one Decoder per stage; the whole model without pp)

The order, each step needing the one before (docs/ARCHITECTURE.md "Where each parallelism lives"):

  1. the whole model on the meta device: nothing is allocated, FQNs are the 1-process ones
  2. pipeline: cut this rank's stages by FQN (framework/parallel/pipeline.py); after FSDP, stage boundaries
     send in the compute dtype where FSDP's mixed precision does not already cast (`send_in_compute_dtype`)
  then for every stage:
  3. TP + SP: the plans of models/plans.py make the parameters DTensors over `tp` (tensor.py); first the model
     transforms that swap modules (`before_sharding`: FP8's linears), on the meta device, each restyling the plan
     for what it swapped (FP8's TP styles)
  4. EP: experts over `ep`, routing on the tp sequence shards (expert.py)
  5. CP: attention exchanges K/V over `cp` (context.py)
  6. activation checkpointing on every k-th block (recompute.py)
  7. the model transforms (framework/numerics/transforms.py: torch.compile per block, compile.py), the same
     list at the same point as LocalEngine: after TP and recompute, before FSDP, whose hooks stay outside
  8. FSDP (zero.py), on the meta device when it can: experts over the edp ranks first, then the blocks and the
     root over `zero.fsdp_mesh` (dp_shard, with cp folded in), moving the dtypes `zero.fsdp_mp_policy` chooses
  9. `to_empty` + per-FQN init (models/init.py): after every sharding, so a rank allocates and draws only its
     shards (FSDP's included), bitwise the 1-process values under any layout; a tied head is re-tied (to_empty
     gives it its own storage). Under cpu_offload the parameters materialize on the host (FSDP's offload wants
     them there), the buffers on the device. fp8 is a module swap on the meta stage (step 3), and qwZ wraps the
     meta weights (its wrapper keeps its type through `to_empty`), so neither changes this; nor does compile
     (step 7 wraps the meta modules, dynamo traces at the first forward). A step-7 transform that reads weight
     values (`ModelTransform.reads_values`; none today) makes its run materialize before step 6 instead (TP/EP
     shards still drawn as such, FSDP's not). Whatever holds parameter objects must look them up after this step:
     `to_empty` from meta gives plain parameters new objects (the MoE expert gradient sync reads them per step).
  after all stages:
 10. tied embeddings across pipeline stages: which ranks swap the embedding and head gradients
 11. ZeRO-0 / DDP over dp_replicate without FSDP: bucketed replica all-reduce, launched during backward (ddp.py)

The optimizers are not built here (framework/train/parallel_engine.py does, and the planner and tests can
parallelize a model without them), nor the pipeline *schedule*: it needs the loss function and the micro-batch
count, so the engine builds one per count at its first use.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from framework.numerics.precision import DTYPES
from framework.numerics.transforms import ModelTransform, Site, apply_model_transforms, restyle_tp_plan
from framework.parallel.config import ParallelConfig
from framework.parallel.context import ContextParallel
from framework.parallel.ddp import ReplicatedGradSync
from framework.parallel.expert import MoEParallel
from framework.parallel.mesh import AXES, ParallelDims
from framework.parallel.pipeline import TiedEmbeddings, cut_stage, local_stages, send_in_compute_dtype
from framework.parallel.recompute import apply_recompute
from framework.parallel.tensor import apply_tensor_parallel
from framework.parallel.zero import apply_fsdp, fsdp_mesh, fsdp_mp_policy
from models.config import ModelConfig
from models.decoder import Decoder


@dataclass
class ParallelModel:
    """This rank's parallelized model and what the step engine needs to run it."""

    parts: list[nn.Module]
    """This rank's pipeline stages, in stage order (one part without pipeline parallelism)."""
    stage_ids: list[int]
    n_stages: int
    moe: MoEParallel
    """Expert-parallel hooks around the step (every call a no-op for a dense model)."""
    context: ContextParallel | None
    """Splits full rows into this rank's cp chunks (None without cp)."""
    tied: TiedEmbeddings | None
    """Tied embedding and head on different pipeline stages (None otherwise)."""
    replica_sync: ReplicatedGradSync | None
    """ZeRO-0 / DDP: the bucketed gradient all-reduce over dp_replicate (None under FSDP or without replicas)."""

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


def parallelize(model_cfg: ModelConfig, pcfg: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh,
                device: torch.device, *, seed: int, precision: str, transforms: Sequence[ModelTransform] = ()
                ) -> ParallelModel:
    """Build and parallelize this rank's part of `model_cfg` on `mesh` (a 5-axis mesh over the layout's ranks).

    Args:
        seed: the run seed of the per-FQN initialization (train.seed).
        precision: train.precision (fp32, bf16 or fp16): FSDP's all-gather dtype and the cp mask dtype.
        transforms: the run's model transforms (framework/numerics/transforms.py `model_transforms`: compile and
            the like), applied to every stage at step 8, where `LocalEngine` applies them to its model.
    """
    coord = dict(zip(AXES, mesh.get_coordinate() or ()))
    moe = MoEParallel(model_cfg, pcfg, dims, mesh)
    context = ContextParallel(mesh["cp"].get_group(), DTYPES[precision], pcfg.cp_comm) if dims.cp > 1 else None
    shard_mesh = fsdp_mesh(mesh, dims)
    mp_policy = fsdp_mp_policy(pcfg, precision)

    with torch.device("meta"):  # 1
        whole = Decoder(model_cfg)
    if dims.pp > 1:  # 2
        stage_ids, layers, n_stages = local_stages(pcfg, coord["pp"], model_cfg.n_layers)
        parts = [cut_stage(whole, s, layers[s], n_stages) for s in stage_ids]
    else:
        stage_ids, n_stages, parts = [0], 1, [whole]

    # the cp ring's P2P exchange runs eager inside each block (context_ring.py): compiled regions break there
    site = Site(tensor_parallel=dims.tp > 1, graph_breaks=context is not None and context.comm == "ring",
                device_type=device.type)
    swaps = [t for t in transforms if t.before_sharding]
    for part in parts:
        apply_model_transforms(part, swaps, site)  # 3
        if dims.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], sequence_parallel=pcfg.sequence_parallel,
                                  loss_parallel=pcfg.loss_parallel, restyle=functools.partial(restyle_tp_plan, swaps))
        moe.parallelize(part)  # 4
        if context is not None:  # 5
            context.install(part)
        early = any(t.reads_values for t in transforms if not t.before_sharding)  # such a step 7 needs values
        if early:
            materialize(part, model_cfg, device, seed)
        apply_recompute(part.layers, pcfg.recompute, pcfg.recompute_every)  # 6
        apply_model_transforms(part, [t for t in transforms if not t.before_sharding], site)  # 7
        # 8: experts over edp (before FSDP wraps their blocks), or hand-synced; resharded after forward only under
        # ZeRO-3, as the blocks (else each micro-batch's forward gathers them again under ZeRO-1/2)
        moe.shard(part, mp_policy=mp_policy, reshard_after_forward=pcfg.zero_stage >= 3)
        if shard_mesh is not None:
            apply_fsdp(part, shard_mesh, pcfg, mp_policy=mp_policy, pipelined=dims.pp > 1)
        if not early:
            materialize(part, model_cfg, device, seed, params_on_host=pcfg.cpu_offload)  # 9
    if dims.pp > 1 and precision != "fp32" and (shard_mesh is None or mp_policy.param_dtype is None):  # 2: p2p dtype
        for part, stage in zip(parts, stage_ids):
            send_in_compute_dtype(part, stage, n_stages, DTYPES[precision])

    tied = None  # 10
    if (model_cfg.tied_embeddings or model_cfg.mtp_depth) and dims.pp > 1:
        tied = TiedEmbeddings.between_stages(parts, stage_ids, n_stages, pcfg.pp_schedule, mesh["pp"], coord["pp"])
    replica_sync = None  # 11
    if dims.fsdp_size == 1 and dims.dp_replicate > 1:
        replica_sync = ReplicatedGradSync([p for part in parts for p in part.parameters()],
                                          mesh["dp_replicate"].get_group(), dims.dp_replicate,
                                          bucket_bytes=pcfg.ddp_bucket_mb * 2**20)
    return ParallelModel(list(parts), stage_ids, n_stages, moe, context, tied, replica_sync)


def materialize(part: Decoder, model_cfg: ModelConfig, device: torch.device, seed: int, *,
                params_on_host: bool = False) -> None:
    """Allocate a meta-device stage (its parameters already in their final sharding) and draw its initial values."""
    part.to_empty(device=torch.device("cpu") if params_on_host else device)
    if params_on_host:
        for module in part.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)
    if model_cfg.tied_embeddings and part.tok_embeddings is not None and part.output is not None:
        # to_empty gives each module its own storage: without this a pp=1 run of a tied model trains untied.
        part.output.weight = part.tok_embeddings.weight
    part.init_weights(seed, device=device)
