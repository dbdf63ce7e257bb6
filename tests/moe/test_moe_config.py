"""MoE configuration: bad values raise ConfigError naming the fix; presets and parameter counts are exact."""

from __future__ import annotations

import pytest

from framework.base.errors import ConfigError
from models import build_model, model_config, param_counts

BAD = [
    (dict(n_experts=4, top_k=5), "top_k=5 must be in [1, model.moe.n_experts=4]"),
    (dict(n_experts=4, top_k=0), "lower top_k or add experts"),
    (dict(n_experts=4, capacity_factor=-1.0), "set e.g. 1.25 or 0"),
    (dict(n_experts=4, every_k_layers=0), "set 1 for every layer"),
    (dict(n_experts=4, aux_loss_coef=-0.1), "aux_loss_coef=-0.1 must be >= 0"),
    (dict(n_experts=4, z_loss_coef=float("nan")), "z_loss_coef=nan must be >= 0"),
    (dict(n_experts=4, bias_update_rate=-1e-3), "bias_update_rate"),
    (dict(n_experts=4, n_shared_experts=-1), "n_shared_experts=-1"),
    (dict(n_experts=-2), "n_experts=-2 must be >= 0"),
    (dict(n_experts=4, first_dense_layers=4), "no layer is MoE"),
    (dict(n_experts=4, router="topk"), "model.moe.router"),
]


@pytest.mark.parametrize("moe,message", BAD)
def test_bad_moe_config_raises_with_fix(moe: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        model_config("test-tiny", moe=moe)
    assert message in str(info.value)


def test_gelu_moe_refused() -> None:
    with pytest.raises(ConfigError, match=r"set model\.mlp=swiglu"):
        model_config("test-tiny", mlp="gelu", moe=dict(n_experts=4))


def test_layer_placement() -> None:
    cfg = model_config("test-tiny", n_layers=8, moe=dict(n_experts=4, every_k_layers=2, first_dense_layers=3))
    assert [i for i in range(8) if cfg.is_moe_layer(i)] == [3, 5, 7]


@pytest.mark.parametrize("moe", [
    dict(n_experts=4, top_k=2, expert_hidden=64),
    dict(n_experts=8, top_k=3, expert_hidden=32, n_shared_experts=2, first_dense_layers=1, every_k_layers=1),
    dict(n_experts=6, top_k=1, every_k_layers=2, router="sigmoid"),
])
def test_param_counts_match_the_built_moe_module(moe: dict[str, object]) -> None:
    cfg = model_config("test-tiny", moe=moe)
    model = build_model(cfg, device="meta")
    pc = param_counts(cfg)
    assert pc.total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    router = sum(p.numel() for n, p in model.named_parameters() if ".router." in n)
    assert (pc.experts, pc.router) == (experts, router)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    assert pc.active_experts == n_moe * int(moe["top_k"]) * experts // (n_moe * int(moe["n_experts"]))


@pytest.mark.parametrize("name,total_b,active_b", [("mixtral-8x7b", 46.70, 12.75), ("deepseek-v3-671b", 671.03, 36.63),
                                                   ("moe-535b", 536.25, 43.96)])
def test_moe_presets_on_meta(name: str, total_b: float, active_b: float) -> None:
    cfg = model_config(name)
    model = build_model(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    assert total == param_counts(cfg).total
    assert abs(total / 1e9 - total_b) < 0.01
    assert abs(param_counts(cfg).active_non_embedding / 1e9 - active_b) < 0.01
