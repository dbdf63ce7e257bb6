"""Routing unit tests: top-k choices, capacity drops, balancing and z losses against hand-computed values, and the
auxiliary-loss-free bias update."""

from __future__ import annotations

import math

import torch

from models.config import MoEConfig, model_config
from models.moe import MoE, Router, capacity_mask, expert_capacity, load_balancing_loss, router_z_loss
from models.moe.step import moe_metrics, update_routing_bias


def _router(kind: str = "softmax", n_experts: int = 4, top_k: int = 2, **kw: object) -> Router:
    """A router whose logits are its input: weight = identity (D = E)."""
    r = Router(n_experts, MoEConfig(n_experts=n_experts, top_k=top_k, router=kind, **kw))  # type: ignore[arg-type]
    with torch.no_grad():
        r.weight.copy_(torch.eye(n_experts))
        r.reset_buffers()
    return r


LOGITS = [[2.0, 1.0, 0.0, -1.0],
          [0.0, 3.0, 1.0, 0.5],
          [1.0, 1.0, 2.5, 0.0]]


def _softmax(row: list[float]) -> list[float]:
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def test_softmax_topk_without_and_with_renormalization() -> None:
    x = torch.tensor(LOGITS)
    r = _router("softmax")(x)
    assert r.expert_idx_NK.tolist() == [[0, 1], [1, 2], [2, 0]]  # ties (token 2: experts 0 and 1) -> lower index
    p = [_softmax(row) for row in LOGITS]
    expected = [[p[0][0], p[0][1]], [p[1][1], p[1][2]], [p[2][2], p[2][0]]]
    torch.testing.assert_close(r.weights_NK, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    rn = _router("softmax", topk_renormalize=True)(x)  # Mixtral: softmax over the chosen logits
    mix = [[math.exp(a) / (math.exp(a) + math.exp(b)) for a, b in ((2, 1), (3, 1))]]
    torch.testing.assert_close(rn.weights_NK[:2, 0], torch.tensor(mix[0]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rn.weights_NK.sum(-1), torch.ones(3))


def test_sigmoid_topk_renormalized_and_probs() -> None:
    x = torch.tensor(LOGITS)
    r = _router("sigmoid")(x)
    sig = [[1 / (1 + math.exp(-v)) for v in row] for row in LOGITS]
    a, b = sig[1][1], sig[1][2]
    torch.testing.assert_close(r.weights_NK[1], torch.tensor([a / (a + b), b / (a + b)]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r.probs_NE[0], torch.tensor([s / sum(sig[0]) for s in sig[0]]), rtol=1e-6, atol=1e-7)


def test_balancing_and_z_loss_hand_computed() -> None:
    x = torch.tensor(LOGITS)
    r = _router("softmax")(x)
    counts = torch.bincount(r.expert_idx_NK.flatten(), minlength=4)
    assert counts.tolist() == [2, 2, 2, 0]
    p = [_softmax(row) for row in LOGITS]
    mean_p = [sum(p[t][e] for t in range(3)) / 3 for e in range(4)]
    f = [2 / 6, 2 / 6, 2 / 6, 0.0]
    expected_lb = 4 * sum(fi * pi for fi, pi in zip(f, mean_p))
    assert abs(load_balancing_loss(r.probs_NE, counts).item() - expected_lb) < 1e-6
    expected_z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS) / 3
    assert abs(float(router_z_loss(r.logits_NE)) - expected_z) < 1e-5
    # the uniform router scores exactly 1 (the Switch normalization)
    uniform = torch.full((8, 4), 0.25)
    assert abs(float(load_balancing_loss(uniform, torch.tensor([4, 4, 4, 4]))) - 1.0) < 1e-7


def test_capacity_drops_lowest_weight_first() -> None:
    # 6 tokens, top-1, 2 experts: expert 0 gets tokens 0, 1, 2, 4 (weights .9 .6 .7 .6); expert 1 tokens 3 and 5
    idx = torch.tensor([[0], [0], [0], [1], [0], [1]])
    w = torch.tensor([[0.9], [0.6], [0.7], [0.8], [0.6], [0.5]])
    cap = expert_capacity(6, 1, 2, capacity_factor=2 / 3)  # ceil(2/3 * 6 * 1 / 2) = 2
    assert cap == 2
    keep = capacity_mask(idx, w, 2, cap)
    # expert 0 keeps its two heaviest (tokens 0, 2); the 0.6 tie (tokens 1, 4) is dropped entirely
    assert keep.flatten().tolist() == [True, False, True, True, False, True]
    keep3 = capacity_mask(idx, w, 2, 3)  # capacity 3: of the tied tokens 1 and 4 the earlier one stays
    assert keep3.flatten().tolist() == [True, True, True, True, False, True]
    assert bool(capacity_mask(idx, w, 2, 6).all())


def test_capacity_in_the_layer_drops_exactly_those_tokens() -> None:
    cfg = model_config(vocab_size=64, hidden=8, n_layers=1, n_heads=2, max_seq_len=16,
                       moe=dict(n_experts=2, top_k=1, expert_hidden=8, capacity_factor=2 / 3, aux_loss_coef=0.0))
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    moe.reset_buffers()
    x = torch.randn(1, 6, 8)
    routing = moe.router(x.view(6, 8))
    keep = capacity_mask(routing.expert_idx_NK, routing.weights_NK, 2, 2)
    y = moe(x).view(6, 8)
    dropped = (~keep.flatten()).nonzero().flatten().tolist()
    assert dropped, "the random router should overload one expert"
    for t in range(6):
        assert bool((y[t] == 0).all()) == (t in dropped)  # no shared expert: a dropped token's MLP output is 0
    metrics = moe_metrics([moe])
    assert metrics["moe/dropped_frac"] == len(dropped) / 6


def test_bias_balancing_reduces_imbalance_of_a_skewed_router() -> None:
    cfg = model_config(vocab_size=64, hidden=16, n_layers=1, n_heads=2, max_seq_len=16,
                       moe=dict(n_experts=8, top_k=2, expert_hidden=8, router="sigmoid", aux_loss_coef=0.0,
                                bias_update_rate=0.02))
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.reset_buffers()
    with torch.no_grad():
        moe.router.weight[:, 0] = torch.linspace(1.5, -1.5, 8)  # feature 0 is always 1: experts 0, 1 favoured
    x = torch.randn(4, 32, 16)
    x[..., 0] = 1.0

    def imbalance() -> float:
        moe(x)
        m = moe_metrics([moe])
        update_routing_bias([moe])
        return m["moe/imbalance"]

    history = [imbalance() for _ in range(60)]
    assert history[0] > 2.5, history[0]
    assert max(history[-10:]) < 1.5, history[-10:]
    assert float(moe.router.expert_bias[0]) < 0 < float(moe.router.expert_bias[-1])
