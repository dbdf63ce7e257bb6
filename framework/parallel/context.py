"""Context parallelism over the mesh's `cp` axis: every sequence split across cp ranks, attention across them.

Causal load balancing (Megatron-core, torchtitan): the sequence is cut into 2 x cp equal chunks and cp rank i
holds chunks i and 2cp-1-i, so every rank has the same share of the causal attention work (an early chunk with
few keys pairs with a late chunk with many). Each rank embeds, projects and rotates only its own tokens (RoPE at
their global positions, or their per-document positions); attention then spans the ranks by one of three
exchanges (parallel.cp_comm), each exact in forward and backward:
- ring (default; context_ring.py): K/V blocks travel around the ring while each block is computed, partial
  outputs merge by log-sum-exp; flash kernels with `is_causal` or no mask; K/V kept for backward at T/cp.
- all_to_all (Ulysses, Jacobs et al. 2023): q, k, v turn from sequence-sharded into head-sharded (H/cp heads of
  the whole sequence), attention runs as on one device (`is_causal`, or the block mask in natural token order),
  and the output turns back; needs n_heads / tp divisible by cp; KV heads that do not split are repeated.
- allgather (Llama 3, Dubey et al. 2024, sec. 3.3.2): K and V of the whole sequence all-gathered (backward:
  reduce-scatter), queries attend through one dense (B, 1, T/cp, T) additive mask in global indices; any mask,
  at the cost of the gathered K/V kept for backward and b x T^2/cp mask elements per forward.
Document masks: ring and all_to_all receive the full rows' document ids and build their mask once per forward
pass (`build_mask`, installed as the decoder's mask builder), shared by every layer.
The loss is each rank's mean over its own tokens; FSDP averages gradients over dp_shard x cp (cp is folded into
the sharding group, torchtitan's dp_shard_cp), which with equal token counts per rank is the full-sequence mean.
Multi-token prediction's shifted labels reach past a rank's chunks: the engine shifts whole rows and cuts them with
`local`; its ranks' loss counts differ, so it weights each rank's mean by its share (models/mtp.py).
Shape legend: B batch, T sequence (full), L local tokens (T / cp), H query heads, K key/value heads, E head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.base.errors import ParallelismError
from framework.parallel.context_ring import RingMasks, ring_attention
from models.attention import DocumentMask, attend, document_mask
from models.documents import DocumentMasking, document_ids, document_positions
from models.layers import masked_attention


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


class _AllToAll(torch.autograd.Function):
    """Scatter dim `scatter` over `group` and gather dim `gather`; backward is the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter, gather)
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter, gather = ctx.dims
        return _all_to_all(grad, ctx.group, gather, scatter), None, None, None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


class ContextParallel:
    """One rank's view of context parallelism: which tokens it holds and how its attention spans the sequence.

    Args:
        group: The cp process group (mesh["cp"]); sequences must have a multiple of 2 x cp tokens.
        mask_dtype: The attention dtype (train.precision), for `comm="allgather"`'s dense additive mask: SDPA
            would otherwise convert a bool mask into a float copy in every layer and keep each for backward.
        comm: parallel.cp_comm: "ring" (K/V blocks around the ring, context_ring.py), "all_to_all" (Ulysses:
            sequence-sharded -> head-sharded q, k, v, whole-sequence attention on H/cp heads) or "allgather"
            (K/V of the whole sequence on every rank, one dense mask).
    """

    def __init__(self, group: dist.ProcessGroup, mask_dtype: torch.dtype = torch.float32, comm: str = "ring") -> None:
        self.group = group
        self.mask_dtype = mask_dtype
        self.comm = comm
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def gather_kv(self, k_BLKE: torch.Tensor, v_BLKE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the whole sequence (rank-major order), differentiable."""
        return (_GatherSequence.apply(k_BLKE, self.group, self.size),  # type: ignore[no-untyped-call]
                _GatherSequence.apply(v_BLKE, self.group, self.size))  # type: ignore[no-untyped-call]

    def install(self, model: nn.Module) -> None:
        """Route every attention layer of `model` (a decoder or a pipeline stage) through this cp exchange."""
        attend = {"ring": self.ring, "all_to_all": self.all_to_all, "allgather": self.allgather}[self.comm]
        for module in model.modules():
            if hasattr(module, "context_attention"):
                setattr(module, "context_attention", attend)  # noqa: B010 (not a submodule)
            if hasattr(module, "mask_builder"):
                setattr(module, "mask_builder", self.build_mask)  # noqa: B010
            if hasattr(module, "seq_shards"):  # multi-token prediction weights its loss by the rank's share
                setattr(module, "seq_shards", self.size)  # noqa: B010

    def build_mask(self, doc_BT: torch.Tensor) -> Any:
        """The document mask of one forward pass from the full rows' document ids (B, T), shared by all layers."""
        t = doc_BT.shape[1]
        if self.comm == "ring":
            q_idx = local_indices(t, self.size, self.rank).to(doc_BT.device)
            k_idx = [local_indices(t, self.size, r).to(doc_BT.device) for r in range(self.size)]
            return RingMasks(doc_BT, q_idx, k_idx, self.rank)
        return document_mask(doc_BT)  # all_to_all: the whole sequence in natural order, on H/cp heads

    def ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: RingMasks | None) -> torch.Tensor:
        o = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.group, mask)
        return o.transpose(1, 2)

    def all_to_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None
                   ) -> torch.Tensor:
        """Ulysses (Jacobs et al. 2023): heads scattered, sequence gathered; tokens put in natural order so the
        single-device kernels (is_causal, or the block mask) apply unchanged. KV heads that do not split over cp
        are repeated to the query heads first (as DeepSpeed-Ulysses does)."""
        if k.shape[2] % self.size:
            k, v = (z.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for z in (k, v))
        t = q.shape[1] * self.size
        order = gathered_indices(t, self.size).to(q.device)
        natural = torch.argsort(order)
        full = [_AllToAll.apply(z, self.group, 2, 1)[:, natural] for z in (q, k, v)]  # type: ignore[no-untyped-call]
        q_all, k_all, v_all = (z.transpose(1, 2) for z in full)
        o = attend(q_all, k_all, v_all, mask).transpose(1, 2)
        return _AllToAll.apply(o[:, order], self.group, 1, 2)  # type: ignore[no-any-return, no-untyped-call]

    def allgather(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each rank's queries against the gathered K/V through the dense mask `shard` built."""
        k, v = self.gather_kv(k, v)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        o = masked_attention(q, k, v, mask, expand_kv=q.shape[1] != k.shape[1] and q.device.type == "cuda")
        return o.transpose(1, 2)

    def shard(self, tokens_BT1: torch.Tensor, documents: DocumentMasking | None
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(local inputs (B, L), local labels (B, L), Decoder keyword arguments) of full rows (B, T+1).

        The keyword arguments are the rotary `positions` (B, L) of the local tokens (global, or restarting per
        document with `documents.reset_positions`), and with `documents.mask` the full rows' `doc_ids` (B, T)
        (ring, all_to_all: the decoder builds the mask once per pass through `build_mask`); allgather takes the
        (B, 1, L, T) additive `attn_mask` against the gathered keys instead, causal in global indices even
        without documents. All derive from the full row every cp rank holds, so they cost no communication.
        """
        inputs, labels = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
        b, t = inputs.shape
        if t % (2 * self.size):
            raise ParallelismError(f"rows of {t} tokens cannot be cut into 2 x cp = {2 * self.size} chunks; "
                                   f"data.seq_len must be a multiple of {2 * self.size}")
        device = inputs.device
        if self.comm == "ring" and documents is not None and documents.mask and device.type != "cpu":
            raise ParallelismError("data.document_mask under parallel.cp_comm=ring runs on CPU only (the ring's "
                                   "per-step masks need the CPU flash kernel; CUDA's takes no mask): set "
                                   "parallel.cp_comm=all_to_all (FlexAttention block masks) or allgather")
        q_idx = local_indices(t, self.size, self.rank).to(device)
        positions = q_idx.expand(b, -1)
        doc = document_ids(inputs, documents.eod_id) if documents is not None else None
        if doc is not None and documents is not None and documents.reset_positions:
            positions = document_positions(doc)[:, q_idx]
        kwargs = {"positions": positions.contiguous()}
        if self.comm == "allgather":
            kwargs["attn_mask"] = self._dense_mask(b, q_idx, doc if documents is not None and documents.mask else None)
        elif doc is not None and documents is not None and documents.mask:
            kwargs["doc_ids"] = doc
        return inputs[:, q_idx].contiguous(), labels[:, q_idx].contiguous(), kwargs

    def local(self, full_BT: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a whole-row tensor (B, T, ...), in the order `shard` cuts the inputs."""
        return full_BT[:, local_indices(full_BT.shape[1], self.size, self.rank).to(full_BT.device)].contiguous()

    def _dense_mask(self, b: int, q_idx: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
        """(B, 1, L, T) additive mask of the local queries against the gathered keys (rows split into micro-batches)."""
        k_idx = gathered_indices(q_idx.numel() * self.size, self.size).to(q_idx.device)
        mask = (k_idx[None, :] <= q_idx[:, None]).expand(b, -1, -1)
        if doc is not None:
            mask = mask & (doc[:, q_idx, None] == doc[:, None, k_idx])
        additive = torch.zeros(mask.shape, dtype=self.mask_dtype, device=q_idx.device)
        return additive.masked_fill_(~mask, float("-inf"))[:, None]


__all__ = ["ContextParallel", "chunks_of_rank", "gathered_indices", "local_indices"]
