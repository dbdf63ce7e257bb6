"""Capacity drops at scale with many tied routing weights: per expert, the kept assignments are exactly the
`capacity` heaviest, ties broken by token position (earlier kept) — checked against a brute-force sort per
expert. Small hand cases pass by luck with an unstable sort; thousands of ties do not."""

from __future__ import annotations

import torch

from models.moe import capacity_mask


def _brute_force(idx: torch.Tensor, w: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    keep = torch.zeros(idx.numel(), dtype=torch.bool)
    flat_e, flat_w = idx.reshape(-1).tolist(), w.reshape(-1).tolist()
    for e in range(n_experts):
        mine = sorted((i for i in range(len(flat_e)) if flat_e[i] == e), key=lambda i: (-flat_w[i], i))
        keep[mine[:capacity]] = True
    return keep.view_as(idx)


def test_capacity_keeps_the_heaviest_then_the_earliest_under_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    n, k, experts = 3000, 2, 8
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)])
    w = torch.randint(1, 4, (n, k), generator=gen).float() / 4  # three weight values: ties everywhere
    for capacity in (1, 200, 700, 800):
        assert torch.equal(capacity_mask(idx, w, experts, capacity), _brute_force(idx, w, experts, capacity))


def test_the_routing_bias_travels_in_the_state_dict() -> None:
    """Aux-loss-free balancing's expert_bias is training state: a checkpoint must hold it, or a resume routes
    differently from the run it continues."""
    from models.config import MoEConfig
    from models.moe import Router

    r = Router(16, MoEConfig(n_experts=4, top_k=2))
    r.expert_bias.copy_(torch.tensor([0.5, -0.25, 0.0, 1.0]))
    state = r.state_dict()
    assert torch.equal(state["expert_bias"], r.expert_bias)
    fresh = Router(16, MoEConfig(n_experts=4, top_k=2))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.expert_bias, r.expert_bias)
