"""Ring attention over the cp ranks, on load-balanced chunks (Liu et al. 2023; torchtitan's and Megatron's p2p cp).

Rank r holds chunks (r, 2cp-1-r) of q, k and v (framework/parallel/context.py). K/V blocks travel around the ring
(rank r sends to r+1) while the current block is computed; after step s rank r holds the K/V of rank r-s. Which
part of the (local q, held K/V) pair is visible follows from the chunk layout, so without document masks every
step is one kernel call with no mask:
  s = 0 (own K/V):  causal over the local tokens (`is_causal`: both chunks are in increasing global order);
  source < r:       all local queries see the source's first chunk, none of its second;
  source > r:       only the local second chunk's queries see it, all of it.
Partial outputs merge by their log-sum-exp (online softmax). Backward reruns the ring with the kernel's backward
given the merged output and log-sum-exp (exact, as flash attention's own backward), dK/dV travelling with their
block and arriving at their owner after cp shifts. Saved for backward: the local q, k, v, output and log-sum-exp
only — no gathered K/V, no mask over the whole sequence, no K/V repeated to the query heads.
Document masks add one (B, 1, Lq, Lk) additive mask per step, built once per forward pass (`RingMasks`).
Kernels: the CPU flash kernel (takes a mask and GQA) on CPU; CUDA's flash kernel without a mask.
Shape legend: B batch, H query heads, K key/value heads, L local tokens, E head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from framework.base.errors import ParallelismError


class RingMasks:
    """Per-step additive masks of document-masked ring attention, for one forward pass (all layers share them).

    `steps[s]` is the (B, 1, Lq, Lk) mask of step s over the visible (query rows, key columns) block and `empty[s]`
    the (B, 1, Lq) rows of it with no visible key (the kernel returns log-sum-exp 0 there; the merge needs -inf).
    """

    def __init__(self, doc_BT: torch.Tensor, q_idx: torch.Tensor, k_idx_of: list[torch.Tensor], rank: int) -> None:
        self.steps: list[torch.Tensor] = []
        self.empty: list[torch.Tensor] = []
        cp = len(k_idx_of)
        for s in range(cp):
            rows, cols = visible(rank, (rank - s) % cp, q_idx.numel())
            qi, ki = q_idx[rows], k_idx_of[(rank - s) % cp][cols]
            allowed = (ki[None, :] <= qi[:, None]) & (doc_BT[:, qi, None] == doc_BT[:, None, ki])
            additive = torch.zeros(allowed.shape, device=doc_BT.device).masked_fill_(~allowed, float("-inf"))
            self.steps.append(additive[:, None])
            self.empty.append(~allowed.any(-1)[:, None])


def visible(rank: int, source: int, length: int) -> tuple[slice, slice]:
    """(query rows, key columns) of rank `rank`'s local tokens that can see keys of rank `source` (causally)."""
    half = length // 2
    if source == rank:
        return slice(0, length), slice(0, length)
    if source < rank:
        return slice(0, length), slice(0, half)
    return slice(half, length), slice(0, length)


def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _fold(dk: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, t, e = dk.shape
    return dk if h == kv_heads else dk.view(b, kv_heads, h // kv_heads, t, e).sum(2)


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (B, H, Lq, E), log-sum-exp (B, H, Lq) fp32) of one block."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask)
        return out, lse
    if mask is not None:  # ContextParallel.shard refuses this before the first forward
        raise ParallelismError("document masks under parallel.cp_comm=ring run on CPU only")
    h = q.shape[1]
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, _expand(k, h), _expand(v, h), 0.0, causal)
    return res[0], res[1]


def _block_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, causal, attn_mask=mask)
        return dq, dk, dv
    h, kv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, h), _expand(v, h)
    _, _, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        g, q, ke, ve, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset)
    return dq, _fold(dk, kv), _fold(dv, kv)


def _shift(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list[Any]]:
    """Start sending `x` to the next rank of the ring and receiving the previous rank's into a new buffer."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list[Any]) -> None:
    for req in reqs:
        req.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of local q (B, H, L, E) to the whole sequence's K/V, which travel around the cp ring."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                masks: RingMasks | None) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, length, e = q.shape
        out = torch.zeros(b, h, length, e, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, length), float("-inf"), device=q.device)
        kv = torch.stack([k, v])
        for s in range(size):
            pending = _shift(kv, group) if s + 1 < size else None
            rows, cols = visible(rank, (rank - s) % size, length)
            mask = masks.steps[s] if masks is not None else None
            o_s, l_s = _block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                      s == 0 and masks is None, mask)
            if masks is not None:
                l_s = l_s.masked_fill(masks.empty[s], float("-inf"))
            new = torch.logaddexp(lse[:, :, rows], l_s)
            # the first step sees every query's own key, so `new` is finite from there on
            out[:, :, rows] = (out[:, :, rows] * (lse[:, :, rows] - new).exp()[..., None]
                               + o_s.float() * (l_s - new).exp()[..., None])
            lse[:, :, rows] = new
            if pending is not None:
                kv = pending[0]
                _wait(pending[1])
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.masks = group, masks
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, masks = ctx.group, ctx.masks
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        length = q.shape[2]
        grad = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for s in range(size):
            pending = _shift(kv, group) if s + 1 < size else None
            rows, cols = visible(rank, (rank - s) % size, length)
            mask = masks.steps[s] if masks is not None else None
            dq_s, dk_s, dv_s = _block_backward(
                grad[:, :, rows].contiguous(), q[:, :, rows].contiguous(), kv[0][:, :, cols].contiguous(),
                kv[1][:, :, cols].contiguous(), out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(),
                s == 0 and masks is None, mask)
            dq[:, :, rows] += dq_s
            dkv[0][:, :, cols] += dk_s
            dkv[1][:, :, cols] += dv_s
            # dK/dV follow their block around the ring: after the last step they reach the block's owner
            sent, reqs = _shift(dkv, group)
            _wait(reqs)
            dkv = sent
            if pending is not None:
                kv = pending[0]
                _wait(pending[1])
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


@torch.compiler.disable
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   masks: RingMasks | None) -> torch.Tensor:
    """Causal ring attention of local q (B, H, L, E) and k, v (B, K, L, E) over `group`; (B, H, L, E).

    Eager under torch.compile (dynamo does not trace P2P ops): a compiled block breaks its graph around it."""
    return RingAttention.apply(q, k, v, group, masks)  # type: ignore[no-any-return, no-untyped-call]


__all__ = ["RingAttention", "RingMasks", "ring_attention", "visible"]
