"""ZeRO data parallelism (Rajbhandari et al. 2020) on FSDP2, and plain replicated data parallelism.

Each `parallel.zero_stage` is one configuration (docs/PARALLELISM.md):
  0  replicate: every rank holds everything; gradients all-reduced over dp_replicate in buckets overlapped
     with backward (DDP; framework/parallel/ddp.py).
  1  FSDP2 over dp_shard, reshard_after_forward=False; gradients accumulate unsharded across micro-batches
     (requires_gradient_sync only on the last one) and are reduce-scattered once per step; the optimizer
     state and the master parameters are sharded.
  2  as 1, but gradients are reduce-scattered after every micro-batch (only a shard is kept).
  3  as 2, and parameters are resharded after forward (all-gathered again for backward).
With dp_replicate > 1 and dp_shard > 1 the FSDP mesh is 2-D (HSDP): shard inside, all-reduce across.
Context parallelism folds cp into the shard group (dp_shard x cp, torchtitan's dp_shard_cp): cp ranks hold
different tokens of one sequence, so their gradients are averaged like data ranks' (`fsdp_mesh`).

ZeRO++ (Wang et al. 2023) on the same FSDP2 units (`apply_fsdp`, framework/parallel/quant.py):
  qwZ  parallel.zero_quantized_weights: parameters all-gathered as block-quantized int8 (tensor-subclass
       `fsdp_pre_all_gather` / `fsdp_post_all_gather`), dequantized into the mp dtype; masters stay fp32.
  hpZ  parallel.zero_hpz_partition_size=s: reshard_after_forward=s, a secondary shard over s consecutive
       data-sharding ranks (dp_shard x cp), so backward all-gathers inside the node.
  qgZ  parallel.zero_quantized_gradients: int8 all-to-all reduce-scatter (`set_custom_reduce_scatter`), two
       hops (node, then across nodes) when s > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from framework.numerics.precision import low_precision_dtype
from framework.parallel.config import ParallelConfig
from framework.parallel.mesh import ParallelDims
from framework.parallel.quant import QuantizedReduceScatter, plain_state_dict_hook, wrap_quantized_weights
from models.decoder import Decoder


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh | None:
    """The mesh FSDP shards over (the one place that chooses it); None when there is nothing to shard over.

    dp_shard alone, or (dp_replicate, dp_shard) for HSDP; with cp > 1 the shard dimension is dp_shard x cp
    ("dp_shard_cp", the root axis `ParallelDims.build_mesh` unflattened into dp_shard and cp).
    """
    if dims.fsdp_size == 1:
        return None
    root, shard = (mesh, "dp_shard") if dims.cp == 1 else (mesh._get_root_mesh(), "dp_shard_cp")
    return root["dp_replicate", shard] if dims.dp_replicate > 1 else root[shard]


def fsdp_mp_policy(cfg: ParallelConfig, precision: str) -> MixedPrecisionPolicy:
    """What FSDP moves in which dtype: the one place that decides it, for dense and expert units alike.

    bf16 by default (`parallel.fsdp_mixed_precision` unset) and fp16 when asked: parameters are all-gathered in
    the compute dtype (half the bytes of fp32) and gradients reduce-scattered in fp32 (summing many ranks'
    gradients in 16 bits loses bits; FSDP2 casts them before the collective), while the sharded master weights
    and optimizer states stay fp32. fp32 training, or `fsdp_mixed_precision: false`: everything moves in fp32.
    qwZ (`parallel.zero_quantized_weights`) takes precedence over this all-gather dtype: the wire carries int8 and
    scales, and `param_dtype` is only what they are dequantized into (`apply_fsdp` installs it per parameter).
    """
    on = cfg.fsdp_mixed_precision if cfg.fsdp_mixed_precision is not None else precision == "bf16"
    dtype = low_precision_dtype(precision)
    if not on or dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_fsdp(model: Decoder, dp_mesh: DeviceMesh, cfg: ParallelConfig, *, mp_policy: MixedPrecisionPolicy,
               pipelined: bool = False) -> list[FSDPModule]:
    """`fully_shard` groups of `cfg.fsdp_layers_per_unit` blocks, then the rest of `model` (embedding, norm, head).

    `mp_policy` comes from `fsdp_mp_policy`. Returns the units in forward order (for explicit prefetching). Under
    pipeline parallelism the schedule owns gradient synchronization (one reduce-scatter per step), so stages 1
    and 2 coincide there.
    """
    kwargs: dict[str, object] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu")
    shard_size = dp_mesh.size(dp_mesh.ndim - 1)
    if cfg.zero_quantized_weights:  # qwZ: before fully_shard, so FSDP shards the subclass and finds its hooks
        wrap_quantized_weights([model], shard_size, cfg.zero_quant_block_size)
        model.register_state_dict_post_hook(plain_state_dict_hook)
    # ZeRO-3 reshards after forward: to the whole shard group, or with hpZ to a node's secondary shard.
    reshard: bool | int = False
    if cfg.zero_stage == 3:
        reshard = cfg.zero_hpz_partition_size if cfg.zero_hpz_partition_size > 1 else True
    keys = list(model.layers.keys())
    units: list[FSDPModule] = []
    for i in range(0, len(keys), cfg.fsdp_layers_per_unit):
        group = [model.layers[k] for k in keys[i:i + cfg.fsdp_layers_per_unit]]
        target: nn.Module | list[nn.Module] = group[0] if len(group) == 1 else group
        # The last unit's parameters are needed again at once by backward: never reshard them.
        last = i + cfg.fsdp_layers_per_unit >= len(keys)
        fully_shard(target, reshard_after_forward=False if last else reshard, **kwargs)  # type: ignore[arg-type, call-overload]
        units.append(group[0])  # type: ignore[arg-type]
    fully_shard(model, reshard_after_forward=False if pipelined else reshard, **kwargs)  # type: ignore[arg-type, call-overload]
    if cfg.fsdp_prefetch > 0 and len(units) > 1:
        _set_prefetch(units, cfg.fsdp_prefetch)
    if cfg.zero_quantized_gradients:
        comm = quantized_reduce_scatter(dp_mesh, cfg)
        for unit in [model, *units]:
            unit.set_custom_reduce_scatter(comm)  # type: ignore[attr-defined]
    return [model, *units]  # type: ignore[list-item]


def quantized_reduce_scatter(dp_mesh: DeviceMesh, cfg: ParallelConfig) -> QuantizedReduceScatter:
    """qgZ's reduce-scatter over the shard dimension of `dp_mesh`; two hops with nodes of zero_hpz_partition_size."""
    s = cfg.zero_hpz_partition_size
    if s == 1:
        return QuantizedReduceScatter(cfg.zero_quant_block_size)
    shard = dp_mesh[dp_mesh.mesh_dim_names[-1]] if dp_mesh.ndim > 1 else dp_mesh  # type: ignore[index]
    ranks = shard.mesh.view(-1, s)  # [node, local]: consecutive shard ranks form a node, as hpZ's groups
    nodes = DeviceMesh(shard.device_type, ranks, mesh_dim_names=("zeropp_inter", "zeropp_intra"))
    return QuantizedReduceScatter(cfg.zero_quant_block_size, intra=nodes.get_group("zeropp_intra"),
                                  inter=nodes.get_group("zeropp_inter"))


def zeropp_axes(parts: Sequence[nn.Module]) -> dict[dist.ProcessGroup, str]:
    """Names for the comm logger of the groups ZeRO++ adds: hpZ's and qgZ's node ("dp_shard_intra") and cross-node
    ("dp_shard_inter") groups."""
    out: dict[dist.ProcessGroup, str] = {}
    for part in parts:
        for mod in part.modules():
            if not isinstance(mod, FSDPModule):
                continue
            state = mod._get_fsdp_state()  # type: ignore[operator]
            for group in state._fsdp_param_groups:
                info = group.post_forward_mesh_info
                if info is not None and info is not group.mesh_info:
                    out[info.mesh.get_group(info.shard_mesh_dim)] = "dp_shard_intra"
                    out[info.mesh.get_group(info.replicate_mesh_dim)] = "dp_shard_inter"
                comm = group._reduce_scatter_comm
                if isinstance(comm, QuantizedReduceScatter) and comm.intra is not None and comm.inter is not None:
                    out[comm.intra], out[comm.inter] = "dp_shard_intra", "dp_shard_inter"
    return out


def _set_prefetch(units: list[FSDPModule], depth: int) -> None:
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])
        unit.set_modules_to_backward_prefetch(list(reversed(units[max(0, i - depth):i])))


def set_micro_batch_sync(root: nn.Module, zero_stage: int, last: bool) -> None:
    """Before each micro-batch's backward: ZeRO-1 syncs only on the last; ZeRO-1/2 keep parameters gathered."""
    if not isinstance(root, FSDPModule):
        return
    root.set_requires_gradient_sync(last or zero_stage >= 2)
    root.set_reshard_after_backward(last or zero_stage >= 3)
    root.set_is_last_backward(last)
