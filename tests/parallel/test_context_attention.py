"""Context-parallel attention alone (framework/parallel/context.py, context_ring.py) against one process.

One 4-rank spawn: cp=2 (two groups) and cp=4; ring, all_to_all and allgather; causal and document-masked;
each rank's outputs and q/k/v gradients of its load-balanced chunks against SDPA over the whole sequence, and
what each exchange keeps for backward (saved-tensor hooks): ring keeps no full-sequence K/V and no mask over
the whole sequence; ring and all_to_all keep no score-shaped tensor and no K/V repeated to the query heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from framework.testing import run_distributed

B, H, KV, E, T, EOD = 2, 4, 2, 6, 32, -1


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, E, generator=gen)
    k, v = torch.randn(B, T, KV, E, generator=gen), torch.randn(B, T, KV, E, generator=gen)
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 5:] += 1
    doc[0, 19:] += 1  # documents crossing chunk edges; row 1 is one document
    return q, k, v, doc, torch.randn(B, T, H, E, generator=gen)


def _reference(masked: bool) -> list[torch.Tensor]:
    q, k, v, doc, g = _inputs()
    leaves = [z.clone().transpose(1, 2).requires_grad_() for z in (q, k, v)]
    if masked:
        allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(*leaves, attn_mask=allowed[:, None], enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    o.backward(g.transpose(1, 2))
    return [o.detach().transpose(1, 2), *(z.grad.transpose(1, 2) for z in leaves)]  # type: ignore[union-attr]


def _case(group: dist.ProcessGroup, comm: str, masked: bool) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    from framework.parallel.context import ContextParallel, local_indices
    from models.documents import DocumentMasking

    ctx = ContextParallel(group, comm=comm)
    q, k, v, doc, g = _inputs()
    idx = local_indices(T, ctx.size, ctx.rank)
    rows = torch.zeros(B, T + 1, dtype=torch.long)
    # shard() derives document ids from the tokens: an EOD ends each document
    tokens = torch.where(torch.diff(doc, append=doc[:, -1:] + 1) != 0, EOD, 7)
    rows[:, :T] = tokens
    _, _, kwargs = ctx.shard(rows, DocumentMasking(EOD) if masked else None)
    mask = kwargs.get("attn_mask")
    if "doc_ids" in kwargs:
        mask = ctx.build_mask(kwargs["doc_ids"])
    leaves = [z[:, idx].clone().requires_grad_() for z in (q, k, v)]
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    attend = {"ring": ctx.ring, "all_to_all": ctx.all_to_all, "allgather": ctx.allgather}[comm]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = attend(*leaves, mask)
    o.backward(g[:, idx])
    return [o.detach(), *(z.grad for z in leaves)], saved  # type: ignore[misc]


def _check(name: str, cp: int, cp_rank: int, got: list[torch.Tensor], saved: list[tuple[int, ...]]) -> list[str]:
    from framework.parallel.context import local_indices

    bad = []
    idx = local_indices(T, cp, cp_rank)
    for what, g, w in zip(("out", "dq", "dk", "dv"), got, _reference("masked=True" in name), strict=True):
        if not torch.allclose(g, w[:, idx], rtol=1e-5, atol=1e-5):
            bad.append(f"{name} rank {cp_rank}: {what} off by {(g - w[:, idx]).abs().max():.2e}")
    if "allgather" in name:
        return bad
    seq = {T, T // cp}
    # all_to_all's document mask on CPU is the decoder's one shared (B, 1, T, T) mask of the single-device
    # reference (a block mask on CUDA: tests/models/test_attention_kernels.py); scores have heads
    if [s for s in saved if len(s) >= 2 and s[-1] in seq and s[-2] in seq
            and not ("all_to_all" in name and s == (B, 1, T, T))]:
        bad.append(f"{name}: a (sequence x sequence) tensor kept for backward: {saved}")
    full_heads = [s for s in saved if len(s) == 4 and s[1] == H]
    if ("ring" in name and len(full_heads) != 2) or ("all_to_all" in name and full_heads):
        bad.append(f"{name}: K/V repeated to the query heads kept (only q and out have H heads): {saved}")
    if "ring" in name and [s for s in saved if T in s]:
        bad.append(f"{name}: a whole-sequence tensor kept: {saved}")
    return bad


def _spawn(rank: int, world: int) -> list[str]:
    groups = {2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2], 4: dist.new_group([0, 1, 2, 3])}
    bad = []
    for cp, group in groups.items():
        for comm in ("ring", "all_to_all", "allgather"):
            for masked in (False, True):
                name = f"cp={cp} {comm} masked={masked}"
                bad += _check(name, cp, dist.get_rank(group), *_case(group, comm, masked))
    return bad


@pytest.mark.distributed
def test_context_parallel_attention_matches_one_process_and_keeps_local_tensors() -> None:
    bad = [line for lines in run_distributed(_spawn, 4, timeout_s=300) for line in lines]
    assert not bad, "\n".join(bad)


def test_ring_refuses_document_masks_off_cpu_at_the_first_batch() -> None:
    from framework.base.errors import ParallelismError
    from framework.parallel.context import ContextParallel
    from models.documents import DocumentMasking

    ctx = ContextParallel.__new__(ContextParallel)  # no process group needed to cut a batch
    ctx.comm, ctx.size, ctx.rank, ctx.mask_dtype = "ring", 2, 0, torch.float32
    rows = torch.zeros(1, T + 1, dtype=torch.long, device="meta")  # any device but CPU
    with pytest.raises(ParallelismError, match="cp_comm=all_to_all"):
        ctx.shard(rows, DocumentMasking(EOD))
    ctx.shard(rows, DocumentMasking(EOD, mask=False))  # positions only: fine
    ctx.comm = "all_to_all"
    assert "doc_ids" in ctx.shard(rows, DocumentMasking(EOD))[2]
