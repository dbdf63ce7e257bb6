"""Expert parallelism: experts sharded over the `ep` axis, tokens moved to them with all-to-all (docs/MOE.md).

The `ep` ranks are carved out of the data and tensor ranks (framework/parallel/mesh.py): each holds
n_experts / ep whole experts. A token group's kept assignments are sorted by expert, sent to the expert's rank
with `all_to_all_single` (uneven splits, autograd-aware: the backward is the reverse all-to-all), computed as
one grouped matmul per rank, sent back and combined in the original slot order.

Under tensor parallelism the experts are *not* sharded over tp (expert-tensor-parallel = 1, as torchtitan and
DeepSeek-V3): each tp rank routes the sequence shard it already holds (sequence parallelism), while capacity
drops are decided on the whole token group from all-gathered choices, so drops never depend on tp. Router
weights are replicated over tp with summed gradients; shared experts are tensor-parallel like a dense MLP.
Expert gradients are reduced over the "edp" ranks that hold the same experts (`ExpertGradSync`, or FSDP over
the edp mesh with `gradient_divide_factor = dp_size`).

Order of application: framework/parallel/parallelize.py (EP right after TP, expert FSDP before the blocks' FSDP).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from framework.base.errors import ParallelismError, divisors
from framework.parallel.config import ParallelConfig
from framework.parallel.mesh import ParallelDims
from models.config import ModelConfig
from models.moe import MoE, combine, permute
from models.moe.experts import GroupedExperts
from models.moe.step import (
    discard_routing_counts,
    format_moe_metrics,
    layer_coefs,
    moe_layers,
    moe_stats,
    set_aux_loss_scale,
    update_routing_bias,
)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_single_autograd(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                               group: dist.ProcessGroup) -> torch.Tensor:
    """`all_to_all_single` along dim 0 with uneven splits; its backward sends the gradients back the same way."""
    return _AllToAll.apply(x, out_splits, in_splits, group)  # type: ignore[no-any-return]


class ExpertParallelDispatcher:
    """Dispatch/combine over an ep group: rank r holds experts [r * E/ep, (r+1) * E/ep)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.n_experts = n_experts
        self.n_local = n_experts // self.ep

    def __call__(self, x_ND: torch.Tensor, expert_idx_NK: torch.Tensor, weights_NK: torch.Tensor,
                 keep_NK: torch.Tensor | None, experts: GroupedExperts) -> torch.Tensor:
        perm = permute(expert_idx_NK, keep_NK, self.n_experts)
        send_E = perm.counts_E
        # recv_SL[s, l]: rows source rank s sends to my local expert l (one small equal-split all-to-all)
        recv = torch.empty_like(send_E)
        dist.all_to_all_single(recv, send_E, group=self.group)
        recv_SL = recv.view(self.ep, self.n_local)
        in_splits = send_E.view(self.ep, self.n_local).sum(1).tolist()
        out_splits = recv_SL.sum(1).tolist()
        x_recv = all_to_all_single_autograd(x_ND[perm.tokens_M], out_splits, in_splits, self.group)
        # rows arrive grouped by source rank, then expert: regroup by local expert (stable: source order kept)
        local_e = torch.repeat_interleave(torch.arange(self.n_local, device=recv.device).repeat(self.ep),
                                          recv.reshape(-1))
        order = torch.sort(local_e, stable=True).indices
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y_sorted = experts(x_recv[order], recv_SL.sum(0))
        y_back = all_to_all_single_autograd(y_sorted[inverse], in_splits, out_splits, self.group)
        return combine(y_back, perm, weights_NK)


class SequenceShards:
    """`models.moe.layer.TokenShards` over the tp group: rank i holds sequence positions [i T/tp, (i+1) T/tp)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def gather(self, t_BtX: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t_BtX) for _ in range(self.size)]
        dist.all_gather(parts, t_BtX.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def local(self, t_BTX: torch.Tensor) -> torch.Tensor:
        return t_BTX.chunk(self.size, dim=1)[self.rank]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


class _SumGrad(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over `group` (Megatron's copy-to-TP-region)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: _SumGrad.apply(w, group)  # type: ignore[no-any-return]


def moe_modules(model: nn.Module) -> Iterator[MoE]:
    for module in model.modules():
        if isinstance(module, MoE):
            yield module


def check_expert_parallel(n_experts: int, ep: int) -> None:
    """Raise `ParallelismError` unless `ep` divides the experts."""
    if n_experts % ep:
        raise ParallelismError(
            f"parallel.ep={ep} must divide model.moe.n_experts={n_experts}; valid ep: {divisors(n_experts)}")


def _shard_experts(moe: MoE, ep_mesh: DeviceMesh) -> None:
    for name, param in list(moe.experts.named_parameters(recurse=False)):
        dt = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        moe.experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _tensor_parallel_moe(moe: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    if moe.shared_gate is not None:  # Qwen2-MoE's [hidden -> 1] gate, replicated, on this rank's tokens (dim 0
        # of (N, D)): its weight gradient comes out Partial and is summed over tp (resolve_partial_grads)
        parallelize_module(moe.shared_gate, tp_mesh, SequenceParallel(sequence_dim=0, use_local_output=True))
    moe.token_shards = SequenceShards(tp_mesh.get_group())
    moe.router.weight = nn.Parameter(distribute_tensor(moe.router.weight.data, tp_mesh, [Replicate()],
                                                       src_data_rank=None))
    moe.router.weight_hook = sum_grad_over(tp_mesh.get_group())
    if moe.shared_experts is not None:  # a dense SwiGLU MLP over the group's shards: Megatron TP
        parallelize_module(moe.shared_experts, tp_mesh, {
            "": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Shard(1))})
    residual = Shard(1) if sequence_parallel else Replicate()
    # The MoE always works on this rank's sequence shard; without SP that is a local slice of the replicated
    # input, and the output is all-gathered back. The residual stream stays plain local tensors (models/plans.py).
    parallelize_module(moe, tp_mesh, PrepareModuleInputOutput(
        input_layouts=(residual,), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(residual,), use_local_output=True))


def apply_expert_parallel(model: nn.Module, *, ep_mesh: DeviceMesh | None = None, tp_mesh: DeviceMesh | None = None,
                          sequence_parallel: bool = True) -> None:
    """Parallelize every MoE layer of `model` (a decoder or a pipeline stage of it) in place.

    Args:
        model: built on any device (meta included), before `init_weights` and FSDP.
        ep_mesh: the 1-D `ep` mesh (`ParallelDims.build_ep_mesh(mesh)["ep"]`); experts become DTensors
            Shard(0) over it, so initialization and checkpoints see their full shapes.
        tp_mesh: the 1-D `tp` mesh when tensor parallelism is on.
        sequence_parallel: the residual stream is sharded over the sequence (else replicated) under TP.
    """
    ep = ep_mesh.size() if ep_mesh is not None else 1
    tp = tp_mesh.size() if tp_mesh is not None else 1
    for moe in moe_modules(model):
        if ep > 1:
            assert ep_mesh is not None
            check_expert_parallel(moe.n_experts, ep)
            _shard_experts(moe, ep_mesh)
            moe.dispatcher = ExpertParallelDispatcher(ep_mesh.get_group(), moe.n_experts)
        if tp > 1:
            assert tp_mesh is not None
            _tensor_parallel_moe(moe, tp_mesh, sequence_parallel)


def set_data_reduce(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Install the sum over data ranks used by the global-batch balancing loss."""
    for moe in moe_modules(model):
        moe.reduce_counts = reduce


def sum_over(groups: list[dist.ProcessGroup]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A reduce function summing a tensor over `groups` (applied one after another; they must be orthogonal).

    Differentiable inputs are not expected: MoE counts and statistics carry no gradient.
    """
    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        for g in groups:
            dist.all_reduce(out, group=g)
        return out
    return reduce


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for moe in moe_modules(model) for p in moe.experts.parameters()]


def apply_expert_fsdp(model: nn.Module, edp_mesh: DeviceMesh, dp_size: int, **fsdp_kwargs: Any) -> None:
    """`fully_shard` every MoE layer's experts over the edp ranks (call before FSDP wraps the blocks).

    FSDP averages the expert gradients over the edp_size ranks; the expert gradient must be divided by the
    data-parallel size instead (see `ExpertGradSync`), so the experts scale their gradients by edp / dp.

    Args:
        model: a decoder or pipeline stage after `apply_expert_parallel` and `init_weights`.
        edp_mesh: `ParallelDims.build_ep_mesh(mesh)["edp"]` (or `["dp_replicate", "edp"]` for HSDP).
        dp_size: data-parallel ranks (dp_replicate x dp_shard).
        **fsdp_kwargs: passed to `fully_shard` (mp_policy, offload_policy, reshard_after_forward).
    """
    from torch.distributed.fsdp import fully_shard

    edp_size = edp_mesh.size()
    for moe in moe_modules(model):
        # shard dim 1 over edp: dim 0 (experts) is already sharded over ep, and FSDP sharding it again makes a
        # _StridedShard placement that gradient-norm code counting Shard placements would miss
        fully_shard(moe.experts, mesh=edp_mesh, shard_placement_fn=lambda _: Shard(1), **fsdp_kwargs)
        moe.experts.grad_scale = edp_size / dp_size


class ExpertGradSync:
    """Without FSDP on the experts: sum expert gradients over the edp group, divide by the data-parallel size.

    Every rank of an ep group holding expert e receives the rows of all its ep peers, so after the sum over the
    edp ranks (the other holders of e) each token of the global batch has contributed once; dividing by dp_size
    turns the sum of per-rank mean losses into the global mean, as the dense gradients' average does.
    """

    def __init__(self, params: list[nn.Parameter], edp_group: dist.ProcessGroup | None, dp_size: int) -> None:
        self.params, self.group, self.dp_size = params, edp_group, dp_size

    @torch.no_grad()
    def __call__(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if self.group is not None:
                dist.all_reduce(g, group=self.group)
            g.div_(self.dp_size)


class MoEParallel:
    """What the parallel engine does for MoE layers, in call order (each call a no-op for a dense model).

        moe = MoEParallel(model_cfg, pcfg, dims, mesh)
        moe.parallelize(part)                 # after TP, before to_empty / init_weights
        moe.shard(part, **fsdp_kwargs)        # after recompute and compile, before FSDP wraps the blocks
        moe.before_step(parts, scale)         # scale: gradient the aux loss gets per forward
        moe.after_backward(parts)             # expert gradient sync when FSDP does not do it
        moe.after_optimizer_step(parts, applied)  # routing-bias update from all-reduced counts (or drop)
        metrics.update(moe.metrics(parts))    # per-layer stats summed over data ranks, merged over stages
    """

    def __init__(self, model_cfg: ModelConfig, pcfg: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh) -> None:
        self.enabled = model_cfg.moe.enabled
        self.pcfg, self.dims, self.mesh = pcfg, dims, mesh
        if not self.enabled:
            return
        check_expert_parallel(model_cfg.moe.n_experts, dims.ep)
        self.ep_mesh = dims.build_ep_mesh(mesh)
        data_groups = [mesh[a].get_group() for a in ("dp_replicate", "dp_shard") if dims.size(a) > 1]
        self.reduce = sum_over(data_groups)
        self.experts_fsdp = False
        self.hand_synced = False
        """Expert gradients are summed by `ExpertGradSync` after backward (no FSDP on the experts)."""
        self.sync_group: dist.ProcessGroup | None = None

    def parallelize(self, part: nn.Module) -> None:
        if not self.enabled:
            return
        apply_expert_parallel(part, ep_mesh=self.ep_mesh["ep"] if self.dims.ep > 1 else None,
                              tp_mesh=self.mesh["tp"] if self.dims.tp > 1 else None,
                              sequence_parallel=self.pcfg.sequence_parallel)
        set_data_reduce(part, self.reduce if any(True for _ in moe_modules(part)) else None)

    def shard(self, part: nn.Module, **fsdp_kwargs: Any) -> None:
        """FSDP over the edp ranks when the dense parameters are FSDP-sharded; else a hand-made gradient sync."""
        if not self.enabled:
            return
        if self.dims.dp_shard > 1:
            if self.pcfg.cpu_offload:
                from torch.distributed.fsdp import CPUOffloadPolicy

                fsdp_kwargs.setdefault("offload_policy", CPUOffloadPolicy())
            names = ("dp_replicate", "edp") if self.dims.dp_replicate > 1 else ("edp",)
            apply_expert_fsdp(part, self.ep_mesh[names], self.dims.dp_size, **fsdp_kwargs)
            self.experts_fsdp = True
        else:
            # dp_shard == 1: the replica sync (if any) already averaged over dp_replicate; the edp ranks inside
            # one replica are tp ranks holding other tokens of the same group -> sum, nothing more to divide
            inner = self.dims.edp_size // self.dims.dp_replicate
            self.sync_group = self.ep_mesh["edp"].get_group() if inner > 1 else None
            self.hand_synced = True

    def before_step(self, parts: list[nn.Module], scale: float) -> None:
        if self.enabled:
            set_aux_loss_scale(parts, scale)

    def after_backward(self, parts: list[nn.Module]) -> None:
        if self.enabled and self.hand_synced:
            # The parameters are looked up now, not in `shard`: a stage built on the meta device is materialized
            # after `shard`, and its `to_empty` replaces every plain parameter with a new object (a list taken
            # then would hold the meta tensors and never see a gradient: tp ranks' expert gradients unsummed).
            ExpertGradSync([p for part in parts for p in expert_parameters(part)], self.sync_group, 1)()

    def after_optimizer_step(self, parts: list[nn.Module], applied: bool = True) -> None:
        if not self.enabled:
            return
        if applied:
            update_routing_bias(parts, self.reduce)
        else:
            discard_routing_counts(parts)  # a skipped step leaves the biases as if it never happened

    def metrics(self, parts: list[nn.Module]) -> dict[str, float]:
        """This step's MoE metrics on every rank: summed over the data ranks, merged over pipeline stages."""
        if not self.enabled:
            return {}
        stats = {k: self.reduce(v) for k, v in moe_stats(parts).items()}
        coefs = {name: layer_coefs(m) for name, m in moe_layers(parts)}
        if self.dims.pp > 1:
            gathered: list[Any] = [None] * self.dims.pp
            dist.all_gather_object(gathered, (stats, coefs), group=self.mesh["pp"].get_group())
            stats, coefs = {}, {}
            for s, c in gathered:
                stats.update(s)
                coefs.update(c)
        return format_moe_metrics(dict(sorted(stats.items(), key=lambda kv: _layer_key(kv[0]))), coefs)


def _layer_key(name: str) -> tuple[int, str]:
    tail = name.rsplit(".", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)
