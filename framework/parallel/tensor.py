"""Tensor + sequence parallelism: shard a decoder (or one pipeline stage of it) in place over the `tp` mesh.

With more tp ranks than KV heads (tp a multiple of model.n_kv_heads), the KV heads are replicated across the
tp ranks, as Megatron-LM does: each rank computes the one KV head its query heads attend with
(`ReplicatedKVHeads`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from models.decoder import Decoder
from models.moe.layer import MoE
from models.plans import Plan, decoder_block_plan, decoder_top_plan, mtp_module_plan


def kv_head_of(tp_rank: int, tp: int, n_kv_heads: int) -> int:
    """The KV head tp rank `tp_rank` needs when tp > n_kv_heads (tp a multiple of n_kv_heads).

    Query heads are split column-wise: rank t holds heads [t n_heads/tp, (t+1) n_heads/tp), and grouped-query
    attention pairs query head h with KV head h // (n_heads / n_kv_heads), so rank t needs KV head t // (tp / kv).
    """
    return tp_rank // (tp // n_kv_heads)


class ReplicatedKVHeads(ParallelStyle):
    """wk / wv when tp > n_kv_heads: the weight is replicated over tp (a `Replicate` DTensor, the full
    (n_kv_heads x head_dim, hidden) matrix), and each rank's forward uses the rows of its KV head (`kv_head_of`).

    Gradients: each rank's local weight gradient holds its query heads' contribution to its KV head's rows, and
    its input gradient its contribution to dx; both are declared `Partial` over tp, so the tp reduction the
    plan already does for dx sums them, and `resolve_partial_grads` sums the weight's (exactly the 1-process
    gradient, every rank then holding it, so the replicas stay identical through the optimizer).
    """

    def __init__(self, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear)
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()])))
        head = kv_head_of(device_mesh.get_local_rank(), device_mesh.size(), self.n_kv_heads)
        rows = slice(head * self.head_dim, (head + 1) * self.head_dim)

        def forward(x: torch.Tensor) -> torch.Tensor:
            bias = _partial_local(module.bias)[rows] if module.bias is not None else None
            return F.linear(_partial_local(x), _partial_local(module.weight)[rows], bias)

        module.forward = forward  # type: ignore[method-assign, assignment]
        return module


def _partial_local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a replicated DTensor whose gradient each rank only contributes to (summed over tp)."""
    return t.to_local(grad_placements=[Partial()]) if isinstance(t, DTensor) else t


def _present(module: Decoder, plan: Plan) -> Plan:
    """The plan entries whose module exists (pipeline stages drop the embedding or the head)."""
    out: Plan = {}
    for fqn, style in plan.items():
        target = module
        try:
            for part in fqn.split("."):
                target = getattr(target, part)
        except AttributeError:
            continue
        if target is not None:
            out[fqn] = style
    return out


def apply_tensor_parallel(model: Decoder, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
                          loss_parallel: bool = True,
                          restyle: Callable[[nn.Module, Plan, DeviceMesh], Plan] = lambda module, plan, mesh: plan
                          ) -> None:
    """Shard every block and the embedding/head of `model` in place following models/plans.py, each plan first
    passed through `restyle` (the model transforms' styles for modules they swapped: FP8's).

    Tied embeddings stay tied within one module: the vocab-parallel embedding and the column-parallel head
    both shard the (vocab, hidden) weight on dim 0, so the head is re-pointed at the embedding's DTensor.
    Compile TP blocks only through `compile_blocks` (sub-layer regions; docs/ARCHITECTURE.md, known torch traps).
    """
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    top = _present(model, decoder_top_plan(sequence_parallel, loss_parallel))
    parallelize_module(model, tp_mesh, restyle(model, top, tp_mesh))
    if model.tok_embeddings is not None:
        vocab_shard_lookup(model.tok_embeddings)
    if tied:
        assert model.output is not None and model.tok_embeddings is not None
        model.output.weight = model.tok_embeddings.weight
    block_plan = decoder_block_plan(sequence_parallel, model.cfg.attention)
    tp, kv = tp_mesh.size(), model.cfg.kv_heads
    if tp > kv:  # Megatron-style KV-head replication (tp a multiple of n_kv_heads: framework/parallel/mesh.py)
        block_plan["attention.wk"] = block_plan["attention.wv"] = ReplicatedKVHeads(kv, model.cfg.head_dim)
    moe_plan = {k: v for k, v in block_plan.items() if not k.startswith("feed_forward")}
    blocks = list(model.layers.values())
    if model.mtp is not None:  # multi-token prediction (models/mtp.py): each depth's projection, norms and block
        for depth in model.mtp.depths.values():
            parallelize_module(depth, tp_mesh, restyle(depth, mtp_module_plan(sequence_parallel), tp_mesh))
            blocks.append(cast(nn.Module, depth.block))
    for block in blocks:
        # MoE (docs/MOE.md): framework/parallel/expert.py parallelizes an MoE layer's feed-forward
        plan = moe_plan if isinstance(block.feed_forward, MoE) else block_plan  # type: ignore[union-attr]
        parallelize_module(block, tp_mesh, restyle(block, _present(block, plan), tp_mesh))  # type: ignore[arg-type]
        if hasattr(block.attention, "shared_key_grad"):  # MLA's replicated rotary key
            block.attention.shared_key_grad = functools.partial(sum_grad_over, tp_mesh)  # type: ignore[union-attr]


def vocab_shard_lookup(embedding: nn.Embedding) -> None:
    """The vocab-parallel embedding's lookup on this rank's rows, so that its weight gradient is this rank's rows.

    DTensor's `RowwiseParallel` embedding looks up a masked local shard in forward (a partial sum over tp), but
    torch has no row-wise sharding rule for `embedding_dense_backward`, so backward computes the gradient of the
    whole (vocab, hidden) table on every tp rank, replicated, and keeps it until FSDP's reduce-scatter: on the
    Llama-3.1-405B first stage (TP8, 16 micro-batches) a 3.9 GiB bf16 gradient per micro-batch and its 7.8 GiB
    fp32 accumulation, 8x the rank's share (the dry run measured it, docs/PLANNER.md). This forward does the
    same masked lookup on the local rows as plain tensors (Megatron's VocabParallelEmbedding): the gradient is
    the `Shard(0)` local rows; the output is the same partial sum, and the plan's output hook reduces it as before.
    """
    weight = embedding.weight
    if not isinstance(weight, DTensor) or not weight.placements[0].is_shard(0):
        return
    mesh, vocab = weight.device_mesh, weight.shape[0]
    rows = -(-vocab // mesh.size())  # torch.chunk's split of Shard(0)
    start = mesh.get_local_rank() * rows

    def forward(ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids.to_local() if isinstance(ids, DTensor) else ids
        table = cast(DTensor, embedding.weight).to_local()  # the unsharded parameter under FSDP; grad -> Shard(0)
        outside = (local_ids < start) | (local_ids >= start + table.shape[0])
        out = F.embedding((local_ids - start).masked_fill(outside, 0), table)
        return DTensor.from_local(out.masked_fill(outside.unsqueeze(-1), 0.0), mesh, [Partial()], run_check=False)

    embedding.forward = forward  # type: ignore[method-assign, assignment]


def sum_grad_over(mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    """Identity forward; the gradient summed over the (1-D) `mesh` in backward (Megatron's "f" operator): for a
    tensor every rank holds whole but whose gradient each rank's heads produce only a share of."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
