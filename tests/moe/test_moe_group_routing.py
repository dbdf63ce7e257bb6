"""Group-limited routing (DeepSeek-V3) against transformers' DeepseekV3TopkRouter, its groups-per-token metric
against a count by hand, and its config checks. Parity under expert parallelism: tests/moe/test_moe_expert_parallel.py
("grouped")."""

from __future__ import annotations

import pytest
import torch

from framework.base.errors import ConfigError
from models.config import MoEConfig, model_config
from models.moe import MoE, Router, moe_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def test_group_limited_sigmoid_routing_matches_transformers_deepseek_v3() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True))
    ours = Router(32, MoEConfig(n_experts=16, top_k=4, router="sigmoid", n_groups=4, topk_groups=2,
                                routed_scale=2.5))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 32, generator=gen) * 0.3)
        hf.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.1)
        ours.weight.copy_(hf.weight)
        ours.expert_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(256, 32, generator=gen)
    _, hf_w, hf_idx = hf(x)
    routing = ours(x)
    order = hf_idx.argsort(dim=-1)  # transformers' top-k is unsorted; Tessera's is best first
    ours_order = routing.expert_idx_NK.argsort(dim=-1)
    torch.testing.assert_close(routing.expert_idx_NK.gather(1, ours_order), hf_idx.gather(1, order), rtol=0, atol=0)
    torch.testing.assert_close(routing.weights_NK.gather(1, ours_order), hf_w.gather(1, order), rtol=0, atol=1e-6)
    groups = (routing.expert_idx_NK // 4).tolist()
    assert max(len(set(g)) for g in groups) == 2  # never more than topk_groups, and used


def test_groups_per_token_metric_counts_the_groups_a_tokens_experts_span() -> None:
    cfg = model_config("test-moe", moe=dict(n_experts=8, top_k=3, expert_hidden=32, n_groups=4, topk_groups=2))
    moe = MoE(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    x = torch.randn(2, 16, cfg.hidden, generator=gen, requires_grad=True)
    expected = [len(set((moe.router(x.detach().reshape(32, -1)).expert_idx_NK[n] // 2).tolist())) for n in range(32)]
    moe(x)
    metrics = moe_metrics([moe])
    assert metrics["moe/groups_per_token"] == pytest.approx(sum(expected) / 32)
    assert 1.0 < metrics["moe/groups_per_token"] <= 2.0


@pytest.mark.parametrize(("moe", "field"), [
    (dict(n_experts=8, top_k=2, n_groups=3), "n_groups"),
    (dict(n_experts=8, top_k=2, n_groups=4, topk_groups=5), "topk_groups"),
    (dict(n_experts=8, top_k=5, n_groups=4, topk_groups=2), "top_k"),
    (dict(n_experts=8, top_k=2, routed_scale=0.0), "routed_scale"),
    (dict(n_experts=8, top_k=2, shared_expert_gate=True), "shared_expert_gate"),
])
def test_group_config_is_checked_by_field(moe: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"model\.moe\.{field}="):
        MoEConfig(**moe).validate()  # type: ignore[arg-type]
