"""The decoder: shapes, causality, tied embeddings, per-FQN layout-independent initialization."""

from __future__ import annotations

import pytest
import torch

from models import build_model, model_config
from models.init import initial_value


def test_forward_shape_and_causality() -> None:
    cfg = model_config("test-tiny")
    model = build_model(cfg, seed=3)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    y = model(x)
    assert y.shape == (2, 16, cfg.vocab_size)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % cfg.vocab_size
    y2 = model(x2)
    torch.testing.assert_close(y[:, :10], y2[:, :10])  # the future never leaks into the past
    assert not torch.allclose(y[:, 10:], y2[:, 10:])


def test_tied_embeddings_share_storage() -> None:
    cfg = model_config("smoke-3m")
    model = build_model(cfg)
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight


def test_init_depends_only_on_seed_and_fqn() -> None:
    cfg = model_config("test-tiny")
    a = build_model(cfg, seed=7)
    meta = build_model(cfg, device="meta")
    b = meta.to_empty(device="cpu")
    b.init_weights(seed=7)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb
        assert torch.equal(pa, pb), na
    c = build_model(cfg, seed=8)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_init_rules() -> None:
    cfg = model_config("test-tiny")
    assert torch.equal(initial_value(cfg, "layers.0.attention_norm.weight", (64,), 0), torch.ones(64))
    wo = initial_value(cfg, "layers.1.attention.wo.weight", (64, 64), 0)
    wq = initial_value(cfg, "layers.1.attention.wq.weight", (64, 64), 0)
    assert wo.std() < wq.std() / 2  # depth-scaled: std / sqrt(2 * 4)
    # wrapper prefixes do not change the value
    wrapped = initial_value(cfg, "layers.1._checkpoint_wrapped_module.attention.wq.weight", (64, 64), 0)
    assert torch.equal(wq, wrapped)


def test_pipeline_stage_parts_optional() -> None:
    cfg = model_config("test-tiny")
    full = build_model(cfg, seed=1)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    first = build_model(cfg, seed=1)
    first.norm, first.output = None, None
    del first.layers["2"], first.layers["3"]
    second = build_model(cfg, seed=1)
    second.tok_embeddings = None
    del second.layers["0"], second.layers["1"]
    torch.testing.assert_close(second(first(x)), full(x))


def test_masked_gqa_with_expanded_kv_equals_sdpa_gqa() -> None:
    """The CUDA form of masked GQA (k, v expanded to the query heads, so the fused kernel that takes a mask runs)
    against SDPA's own `enable_gqa`: the same outputs and gradients."""
    from models.documents import block_causal_mask
    from models.layers import masked_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 12, 8, generator=gen)
    k, v = torch.randn(2, 2, 12, 8, generator=gen), torch.randn(2, 2, 12, 8, generator=gen)
    mask = block_causal_mask(torch.tensor([[0] * 5 + [1] * 7, [0] * 12]))
    runs = []
    for expand in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = masked_attention(*leaves, mask, expand_kv=expand)
        out.square().sum().backward()
        runs.append([out.detach(), *(t.grad for t in leaves)])
    for got, want in zip(runs[1], runs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_initial_shard_is_the_full_values_box_drawn_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every parameter of a MoE model, cut into uneven row, column and expert boxes: `initial_shard` equals the
    box of `initial_value` bitwise, with draws of at most DRAW_CHUNK (+16) elements (lowered to 32 here)."""
    import models.init as init
    from models.decoder import Decoder

    cfg = model_config("test-tiny", moe=dict(n_experts=4, top_k=2, expert_hidden=24))
    draws: list[int] = []
    real = torch.Tensor.normal_

    def spy(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        draws.append(self.numel())
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    with torch.device("meta"):
        model = Decoder(cfg)
    monkeypatch.setattr(init, "DRAW_CHUNK", 32)
    checked = 0
    for fqn, p in model.named_parameters():
        shape = tuple(p.shape)
        full = init.initial_value(cfg, fqn, shape, seed=11)
        for part in range(3):  # thirds along each dimension: uneven boxes, first, middle and last
            for dim in range(len(shape)):
                lo, hi = shape[dim] * part // 3, shape[dim] * (part + 1) // 3
                offset = tuple(lo if d == dim else 0 for d in range(len(shape)))
                local = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
                monkeypatch.setattr(torch.Tensor, "normal_", spy)
                got = init.initial_shard(cfg, fqn, shape, 11, offset, local)
                monkeypatch.setattr(torch.Tensor, "normal_", real)
                assert torch.equal(got, full.narrow(dim, lo, hi - lo)), (fqn, dim, part)
                checked += 1
    assert checked > 50 and draws and max(draws) <= 32 + 16, max(draws)
