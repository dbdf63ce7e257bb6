"""Mixture-of-experts layers in a dry run: routing values replaced by one stated assumption, even routing.

A MoE layer's all-to-all split sizes, capacity drops and per-expert row counts come from the router's choices,
which a fake tensor does not have. The dry run therefore rehearses MoE under **even routing**: token n of a
rank's token group sends its k-th choice to expert (n K + k) mod E. Every expert of every rank then receives
N K / E rows (when E divides N K), which is what the auxiliary-loss-free and load-balancing losses aim at; a
real run's imbalance adds to the all-to-all buffers and the busiest expert's activations, and the table says
which figures assume it.

`even_routing()` applies the assumption to the router — in the dry run and in its gloo ground truth alike, so
the two run the same program. Under `fake=True` it also answers the three places that read routing values
from a peer, with what a real world under even routing returns (every rank routes alike):
- `SequenceShards.gather` of the expert choices (tp > 1): tp copies of this rank's choices;
- the expert-count exchange (`all_to_all_single` of int64 counts): every source sends this rank's experts the
  counts this rank sends them;
- the capacity drop order reads routing weights: ones stand in (under even routing every expert receives the
  same count, so the number dropped is the same whatever the order).
The index tensors are computed as real tensors (they are positions, not data), so permutations, splits and
counts are ordinary values and the activations they index stay fake.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily


def even_choices(n_tokens: int, top_k: int, n_experts: int, device: torch.device) -> torch.Tensor:
    """(N, K) expert ids: token n's k-th choice is (n K + k) mod E (distinct per token while K <= E)."""
    with unset_fake_temporarily():
        flat = torch.arange(n_tokens * top_k, device="cpu") % n_experts
        return flat.view(n_tokens, top_k).to(device if device.type != "meta" else "cpu")


def _is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def even_routing(fake: bool) -> Iterator[None]:
    """Route every MoE layer evenly (module docstring); with `fake`, answer the peers' routing values too."""
    from framework.parallel.expert import SequenceShards
    from models.moe import layer as moe_layer
    from models.moe.experts import GroupedExperts, grouped_mm_available
    from models.moe.router import Router, Routing

    saved: list[tuple[Any, str, Any]] = [(Router, "forward", Router.forward)]
    router_forward = Router.forward

    def forward(self: Router, x_ND: torch.Tensor) -> Routing:
        routing = router_forward(self, x_ND)
        idx = even_choices(x_ND.shape[0], self.top_k, self.n_experts, x_ND.device)
        scores = routing.probs_NE if self.kind == "softmax" else routing.logits_NE.sigmoid()
        weights = scores.gather(-1, idx)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(idx, weights, routing.probs_NE, routing.logits_NE)

    Router.forward = forward  # type: ignore[method-assign]
    if fake:
        from framework.parallel.expert import ExpertParallelDispatcher
        from models.moe.dispatch import LocalDispatcher

        saved += [(SequenceShards, "gather", SequenceShards.gather), (moe_layer.MoE, "_decide", moe_layer.MoE._decide),
                  (ExpertParallelDispatcher, "__call__", ExpertParallelDispatcher.__call__),
                  (LocalDispatcher, "__call__", LocalDispatcher.__call__),
                  (GroupedExperts, "_loop", GroupedExperts.__dict__["_loop"])]
        _patch_fake_peers(SequenceShards, moe_layer.MoE)
        with unset_fake_temporarily():  # the kernel choice is the CPU's, as in the real run here
            for dtype in (torch.float32, torch.bfloat16):
                grouped_mm_available(torch.device("cpu"), dtype)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _patch_fake_peers(shards_cls: Any, moe_cls: Any) -> None:
    from framework.parallel.expert import ExpertParallelDispatcher
    from models.moe.dispatch import LocalDispatcher
    from models.moe.experts import GroupedExperts

    gather, decide = shards_cls.gather, moe_cls._decide

    def shards_gather(self: Any, t_BtX: torch.Tensor) -> torch.Tensor:
        out = gather(self, t_BtX)  # the collective runs (and is counted); its contents are the fake backend's
        if _is_fake(t_BtX) or t_BtX.is_floating_point():
            return out
        return torch.cat([t_BtX] * self.size, dim=1)

    def moe_decide(self: Any, idx_NK: torch.Tensor, weights_NK: torch.Tensor, b: int, t: int) -> Any:
        with unset_fake_temporarily():  # positions, not data: counts and masks are real values
            ones = torch.ones(weights_NK.shape, dtype=weights_NK.dtype, device=idx_NK.device)
            return decide(self, idx_NK, ones, b, t)

    shards_cls.gather = shards_gather
    moe_cls._decide = moe_decide
    GroupedExperts._loop = staticmethod(_experts_loop)  # type: ignore[method-assign]
    ExpertParallelDispatcher.__call__ = _expert_parallel_dispatch  # type: ignore[method-assign]
    LocalDispatcher.__call__ = _local_dispatch  # type: ignore[method-assign]


def _experts_loop(x_MD: torch.Tensor, counts_E: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """`GroupedExperts._loop` with its row counts read outside FakeTensorMode (they are real values here)."""
    import torch.nn.functional as F

    with unset_fake_temporarily():
        sizes = counts_E.tolist()
    outs = []
    for e, rows in enumerate(torch.split(x_MD, sizes)):
        h = F.silu(rows @ w1[e].T) * (rows @ w3[e].T)
        outs.append(h @ w2[e].T)
    return torch.cat(outs) if outs else x_MD.new_zeros(0, w2.shape[1])


def _local_dispatch(self: Any, x_ND: torch.Tensor, expert_idx_NK: torch.Tensor, weights_NK: torch.Tensor,
                    keep_NK: torch.Tensor | None, experts: Any) -> torch.Tensor:
    """`LocalDispatcher.__call__` with the permutation computed on real index tensors."""
    from models.moe.dispatch import combine, permute

    with unset_fake_temporarily():
        perm = permute(expert_idx_NK, keep_NK, experts.w1.shape[0])
    return combine(experts(x_ND[perm.tokens_M], perm.counts_E), perm, weights_NK)


def _expert_parallel_dispatch(self: Any, x_ND: torch.Tensor, expert_idx_NK: torch.Tensor, weights_NK: torch.Tensor,
                              keep_NK: torch.Tensor | None, experts: Any) -> torch.Tensor:
    """`ExpertParallelDispatcher.__call__` step for step, its index arithmetic on real tensors and the count
    exchange answered as every peer would under even routing (module docstring)."""
    from framework.parallel.expert import all_to_all_single_autograd
    from models.moe.dispatch import combine, permute

    with unset_fake_temporarily():
        perm = permute(expert_idx_NK, keep_NK, self.n_experts)
        send_E = perm.counts_E
        recv = torch.empty_like(send_E)
        dist.all_to_all_single(recv, send_E, group=self.group)  # moves nothing on the fake backend: answered below
        mine = send_E.view(self.ep, self.n_local)[dist.get_rank(self.group)]
        recv.view(self.ep, self.n_local).copy_(mine.expand(self.ep, -1))
        recv_SL = recv.view(self.ep, self.n_local)
        in_splits = send_E.view(self.ep, self.n_local).sum(1).tolist()
        out_splits = recv_SL.sum(1).tolist()
        local_e = torch.repeat_interleave(torch.arange(self.n_local, device=recv.device).repeat(self.ep),
                                          recv.reshape(-1))
        order = torch.sort(local_e, stable=True).indices
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        local_counts = recv_SL.sum(0)
    x_recv = all_to_all_single_autograd(x_ND[perm.tokens_M], out_splits, in_splits, self.group)
    y_sorted = experts(x_recv[order], local_counts)
    y_back = all_to_all_single_autograd(y_sorted[inverse], in_splits, out_splits, self.group)
    return combine(y_back, perm, weights_NK)
