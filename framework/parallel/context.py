"""Context parallelism over the mesh's `cp` axis: every sequence split across cp ranks, K/V all-gathered.

Causal load balancing (Megatron-core, torchtitan): the sequence is cut into 2 x cp equal chunks and cp rank i
holds chunks i and 2cp-1-i, so every rank has the same share of the causal attention work (an early chunk with
few keys pairs with a late chunk with many). Each rank embeds, projects and rotates only its own tokens (RoPE at
their global positions, or their per-document positions), then all-gathers K and V of the whole sequence over
cp before attention. The all-gather is an autograd function whose backward is the matching reduce-scatter (sum),
so the backward is exact: every key's gradient collects the contributions of all ranks' queries. All-gather is
Llama 3's choice for GQA (Dubey et al. 2024, sec. 3.3.2): K/V are n_kv_heads / n_heads of the activations, the
gather overlaps poorly but costs (cp-1)/cp x 2 x T x n_kv_heads x head_dim elements per layer, and unlike a ring
it handles any mask (document masks) with one SDPA call. A ring with an online-softmax merge would keep K/V
memory at T/cp instead of T; docs/PARALLELISM.md says when that pays.

Queries attend through an explicit (B, 1, T/cp, T) additive mask built from global token indices (causal) and
document ids: keys arrive in gathered (rank-major) order, which the mask accounts for, so nothing is permuted.
The mask is dense, b x T^2/cp elements per forward (shared by all layers): at 128k tokens and cp=16 that is
2 GiB in bf16 per sequence, so very long contexts want a lower-right causal kernel per chunk or flex attention
instead (docs/PARALLELISM.md).
The loss is each rank's mean over its own tokens; FSDP averages gradients over dp_shard x cp (cp is folded into
the sharding group, torchtitan's dp_shard_cp), which with equal token counts per rank is the full-sequence mean.
Shape legend: B batch, T sequence (full), L local tokens (T / cp), K key/value heads, E head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.base.errors import ParallelismError
from models.documents import DocumentMasking, document_ids, document_positions


def chunks_of_rank(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of 2 x cp sequence chunks cp rank `cp_rank` holds: (i, 2cp-1-i)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """(L,) global token indices held by `cp_rank`, in the order the rank holds them."""
    size = seq_len // (2 * cp)
    a, b = chunks_of_rank(cp_rank, cp)
    return torch.cat([torch.arange(a * size, (a + 1) * size), torch.arange(b * size, (b + 1) * size)])


def gathered_indices(seq_len: int, cp: int) -> torch.Tensor:
    """(T,) global token index of every key after the all-gather (rank-major: rank 0's tokens first)."""
    return torch.cat([local_indices(seq_len, cp, r) for r in range(cp)])


# torch 2.13 renamed them (the old names warn); the GPU machine's torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1 over `group`; backward reduce-scatters (sums) the gradient back to its owner."""

    @staticmethod
    def forward(ctx: Any, x_BLKE: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        local = x_BLKE.transpose(0, 1).contiguous()  # (L, B, K, E): gather along dim 0
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather(out, local, group=group)
        return out.transpose(0, 1)  # (B, T, K, E), rank-major

    @staticmethod
    def backward(ctx: Any, grad_BTKE: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = grad_BTKE.transpose(0, 1).contiguous()
        out = full.new_empty((full.shape[0] // ctx.size, *full.shape[1:]))
        _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.transpose(0, 1), None, None


class ContextParallel:
    """One rank's view of context parallelism: which tokens it holds and how it exchanges K/V.

    Args:
        group: The cp process group (mesh["cp"]); sequences must have a multiple of 2 x cp tokens.
        mask_dtype: The attention dtype (train.precision). The mask goes to SDPA additive (0 / -inf) in it:
            SDPA would otherwise convert a bool mask into a float copy in every layer and keep each for backward
            (measured, bench/context_parallel.py); one shared copy per forward costs b x s/cp x s elements.
    """

    def __init__(self, group: dist.ProcessGroup, mask_dtype: torch.dtype = torch.float32) -> None:
        self.group = group
        self.mask_dtype = mask_dtype
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def gather_kv(self, k_BLKE: torch.Tensor, v_BLKE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the whole sequence (rank-major order), differentiable."""
        return (_GatherSequence.apply(k_BLKE, self.group, self.size),  # type: ignore[no-untyped-call]
                _GatherSequence.apply(v_BLKE, self.group, self.size))  # type: ignore[no-untyped-call]

    def install(self, model: nn.Module) -> None:
        """Make every attention layer of `model` (a decoder or a pipeline stage) all-gather K/V over cp."""
        for module in model.modules():
            if hasattr(module, "kv_exchange"):
                setattr(module, "kv_exchange", self.gather_kv)  # noqa: B010 (not a submodule)

    def shard(self, tokens_BT1: torch.Tensor, documents: DocumentMasking | None
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(local inputs (B, L), local labels (B, L), Decoder keyword arguments) of full rows (B, T+1).

        The keyword arguments are the rotary `positions` (B, L) of the local tokens (global, or restarting per
        document with `documents.reset_positions`) and the (B, 1, L, T) additive `attn_mask` against the gathered
        keys: causal in global indices, and within one document with `documents.mask`. Both derive from the full
        row every cp rank holds, so they cost no communication.
        """
        inputs, labels = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
        b, t = inputs.shape
        if t % (2 * self.size):
            raise ParallelismError(f"rows of {t} tokens cannot be cut into 2 x cp = {2 * self.size} chunks; "
                                   f"data.seq_len must be a multiple of {2 * self.size}")
        device = inputs.device
        q_idx = local_indices(t, self.size, self.rank).to(device)
        k_idx = gathered_indices(t, self.size).to(device)
        mask = (k_idx[None, :] <= q_idx[:, None]).expand(b, -1, -1)
        positions = q_idx.expand(b, -1)
        if documents is not None:
            doc = document_ids(inputs, documents.eod_id)
            if documents.mask:
                mask = mask & (doc[:, q_idx, None] == doc[:, None, k_idx])
            if documents.reset_positions:
                positions = document_positions(doc)[:, q_idx]
        additive = torch.zeros(mask.shape, dtype=self.mask_dtype, device=device).masked_fill_(~mask, float("-inf"))
        kwargs = {"attn_mask": additive[:, None], "positions": positions.contiguous()}
        return inputs[:, q_idx].contiguous(), labels[:, q_idx].contiguous(), kwargs


__all__ = ["ContextParallel", "chunks_of_rank", "gathered_indices", "local_indices"]
