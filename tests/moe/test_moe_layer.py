"""The MoE layer against a per-token reference, the grouped-matmul path against the loop, aux-loss gradients,
activation checkpointing, initialization and the LocalEngine hook."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from framework.engine import cross_entropy
from framework.train.config import TrainConfig
from framework.train.local_engine import LocalEngine
from models import build_model, model_config
from models.moe import MoE, capacity_mask, expert_capacity, grouped_mm_available, load_balancing_loss, router_z_loss
from models.moe.step import moe_metrics

SMALL = dict(vocab_size=64, hidden=16, n_layers=2, n_heads=2, max_seq_len=32)


def _moe(seed: int = 0, **moe: object) -> MoE:
    cfg = model_config(**SMALL, moe={"n_experts": 4, "top_k": 2, "expert_hidden": 8, **moe})
    torch.manual_seed(seed)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.reset_buffers()
    return layer


def _reference(layer: MoE, x_BTD: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over the kept chosen experts of weight * SwiGLU_e(x), plus the shared MLP."""
    x = x_BTD.reshape(-1, x_BTD.shape[-1])
    r = layer.router(x)
    keep = torch.ones_like(r.expert_idx_NK, dtype=torch.bool)
    if layer.moe_cfg.capacity_factor > 0:
        cap = expert_capacity(x.shape[0], layer.top_k, layer.n_experts, layer.moe_cfg.capacity_factor)
        keep = capacity_mask(r.expert_idx_NK, r.weights_NK, layer.n_experts, cap)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in range(layer.top_k):
            if keep[t, k]:
                e = int(r.expert_idx_NK[t, k])
                acc = acc + r.weights_NK[t, k] * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
        rows.append(acc)
    y = torch.stack(rows)
    if layer.shared_experts is not None:
        y = y + layer.shared_experts(x)
    return y.view_as(x_BTD)


@pytest.mark.parametrize("moe", [dict(), dict(capacity_factor=0.75), dict(n_shared_experts=2, router="sigmoid"),
                                 dict(top_k=1, capacity_factor=1.0, topk_renormalize=True)])
def test_layer_matches_per_token_reference(moe: dict[str, object]) -> None:
    layer = _moe(**moe)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not grouped_mm_available(torch.device("cpu"), torch.float32),
                    reason="torch._grouped_mm does not run on this CPU build")
def test_grouped_mm_matches_loop_forward_and_backward() -> None:
    grads = {}
    outs = {}
    x0 = torch.randn(3, 7, 16)
    for impl in ("loop", "grouped_mm"):
        layer = _moe(seed=1, experts_impl=impl, capacity_factor=0.5)  # capacity: some experts get few rows
        x = x0.clone().requires_grad_(True)
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs[impl] = y.detach()
        grads[impl] = [x.grad] + [p.grad for p in layer.parameters()]
    torch.testing.assert_close(outs["grouped_mm"], outs["loop"], rtol=1e-5, atol=1e-6)
    for a, b in zip(grads["grouped_mm"], grads["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_groups_start_aligned_and_equal_the_loop(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
                                                            ) -> None:
    """Unaligned counts with empty experts (first, middle, last): every offset `torch._grouped_mm` is handed (by
    the layer and by the availability probe) is a multiple of 16 bytes of rows (8 for bf16, 4 for fp32), and the
    outputs and all gradients equal the per-expert loop's."""
    from models.moe import experts as experts_mod
    from models.moe.experts import GroupedExperts, group_alignment

    seen: list[list[int]] = []
    real = torch._grouped_mm

    def spy(a: torch.Tensor, b: torch.Tensor, *args: object, offs: torch.Tensor | None = None, **kw: object
            ) -> torch.Tensor:
        seen.append([] if offs is None else offs.tolist())
        return real(a, b, *args, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    monkeypatch.setattr(experts_mod, "_GROUPED_MM_OK", {})
    assert experts_mod.grouped_mm_available(torch.device("cpu"), dtype)
    counts = torch.tensor([0, 3, 5, 0, 1, 7, 2, 0])  # 18 rows; cumulative ends 3, 8, 9, 16, 18: few aligned
    x0 = torch.randn(int(counts.sum()), 16, dtype=dtype)
    outs, grads = {}, {}
    for impl in ("loop", "grouped_mm"):
        torch.manual_seed(3)
        layer = GroupedExperts(len(counts), 16, 24, impl=impl)  # type: ignore[arg-type]
        for w in (layer.w1, layer.w2, layer.w3):
            torch.nn.init.normal_(w, std=0.2)
        x = x0.clone().requires_grad_(True)
        y = layer(x, counts)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs[impl], grads[impl] = y.detach().float(), [x.grad] + [w.grad for w in (layer.w1, layer.w2, layer.w3)]
    align = group_alignment(dtype)
    assert seen and all(o % align == 0 for offs in seen for o in offs), (align, seen)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs["grouped_mm"], outs["loop"], **tol)  # type: ignore[arg-type]
    for a, b in zip(grads["grouped_mm"], grads["loop"], strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a.float(), b.float(), **tol)  # type: ignore[arg-type]
    assert grads["grouped_mm"][1][[0, 3, 7]].eq(0).all()  # experts without rows: zero gradient


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_mm_probe_ignores_the_callers_grad_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's answer is cached for the process: a first call from an evaluation (no_grad) or `generate`
    (inference_mode) must give the answer a training forward gets, else every later forward runs the loop."""
    from models.moe import experts as experts_mod

    monkeypatch.setattr(experts_mod, "_GROUPED_MM_OK", {})
    expected = experts_mod.grouped_mm_available(torch.device("cpu"), torch.float32)
    for mode in (torch.no_grad, torch.inference_mode):
        monkeypatch.setattr(experts_mod, "_GROUPED_MM_OK", {})
        with mode():
            assert experts_mod.grouped_mm_available(torch.device("cpu"), torch.float32) == expected, mode


def test_auto_falls_back_to_the_loop_when_unaligned() -> None:
    cfg = model_config(**{**SMALL, "hidden": 18, "n_heads": 3},
                       moe=dict(n_experts=4, top_k=2, expert_hidden=5))  # 5 * 4 bytes: not 16-byte aligned
    layer = MoE(cfg)
    assert not layer.experts.use_grouped_mm(torch.zeros(1, 18))


def test_aux_loss_gradient_equals_adding_it_to_the_loss() -> None:
    """The injector's gradient (scale s) == the gradient of s * (coef * lb + zcoef * z) added to the loss."""
    layer = _moe(aux_loss_coef=0.3, z_loss_coef=0.05)
    x = torch.randn(2, 6, 16)
    target = torch.randn(2, 6, 16)
    layer.aux_loss_scale = 0.5
    ((layer(x) - target) ** 2).mean().backward()
    injected = [p.grad.clone() for p in layer.parameters()]  # type: ignore[union-attr]
    layer.zero_grad()
    layer.aux_loss_scale = 0.0
    r = layer.router(x.view(-1, 16))
    counts = torch.bincount(r.expert_idx_NK.flatten(), minlength=4)
    aux = 0.3 * load_balancing_loss(r.probs_NE, counts) + 0.05 * router_z_loss(r.logits_NE)
    (((layer(x) - target) ** 2).mean() + 0.5 * aux).backward()
    for a, p in zip(injected, layer.parameters()):
        torch.testing.assert_close(a, p.grad)
    assert float(layer.router.weight.grad.abs().sum()) > 0  # type: ignore[union-attr]


def test_activation_checkpointing_counts_tokens_once() -> None:
    layer = _moe()
    x = torch.randn(2, 6, 16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    m = moe_metrics([layer])
    assert sum(v for k, v in m.items() if "/tokens_e" in k) == 2 * 6 * 2


def test_init_is_per_fqn_and_depth_scaled() -> None:
    cfg = model_config("test-moe", moe=dict(n_experts=4, top_k=2, expert_hidden=64, first_dense_layers=1,
                                            n_shared_experts=1))
    a = build_model(cfg, seed=3)
    meta = build_model(cfg, seed=3, device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    for (name, p), q in zip(a.named_parameters(), meta.parameters()):
        assert torch.equal(p, q), name
    for name, buf in meta.named_buffers():
        if name.endswith("expert_bias"):
            assert torch.equal(buf, torch.zeros(4)), name
    experts = a.layers["1"].feed_forward.experts
    assert 0.018 < float(experts.w1.detach().std()) < 0.022
    assert 0.018 / 8**0.5 < float(experts.w2.detach().std()) < 0.022 / 8**0.5  # depth-scaled: std / sqrt(2 * 4 layers)
    assert not torch.equal(experts.w1[0], experts.w1[1])
    assert type(a.layers["0"].feed_forward).__name__ == "FeedForward"


def test_local_engine_scales_aux_loss_per_micro_batch_and_reports_metrics() -> None:
    cfg = model_config("test-moe", moe=dict(n_experts=4, top_k=2, expert_hidden=64, aux_loss_coef=0.1,
                                            z_loss_coef=0.01, capacity_factor=1.0))
    eng = LocalEngine(cfg, TrainConfig(seed=5, micro_batch_size=2, global_batch_size=4), torch.device("cpu"))
    batch = torch.randint(0, 512, (2, 2, 17))
    loss = eng.forward_backward(batch)
    got = {n: p.grad.clone() for n, p in eng.model.named_parameters()}  # type: ignore[union-attr]
    metrics = eng.extra_metrics()
    assert {"moe/layers.0/imbalance", "moe/layers.3/dropped_frac", "moe/layers.2/tokens_e3", "moe/aux_loss"} <= set(
        metrics)
    assert metrics["moe/layers.0/dropped_frac"] > 0
    # explicit: mean over micro-batches of CE + the sum of every layer's aux, computed from captured inputs
    model = build_model(cfg, seed=5)
    captured: list[torch.Tensor] = []
    for blk in model.layers.values():
        blk.feed_forward.register_forward_hook(lambda m, inp, out: captured.append(inp[0]))
        blk.feed_forward.aux_loss_scale = 0.0
    total = torch.zeros(())
    aux_sum = 0.0
    for mb in batch:
        captured.clear()
        ce = cross_entropy(model(mb[:, :-1]), mb[:, 1:])
        aux = torch.zeros(())
        for blk, h in zip(model.layers.values(), captured):
            r = blk.feed_forward.router(h.reshape(-1, 64))
            counts = torch.bincount(r.expert_idx_NK.flatten(), minlength=4)
            aux = aux + 0.1 * load_balancing_loss(r.probs_NE, counts) + 0.01 * router_z_loss(r.logits_NE)
        ((ce + aux) / 2).backward()
        total += ce.detach() / 2
        aux_sum += float(aux.detach()) / 2
    assert abs(loss - float(total)) < 1e-6
    assert abs(metrics["moe/aux_loss"] - aux_sum) < 1e-6
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
