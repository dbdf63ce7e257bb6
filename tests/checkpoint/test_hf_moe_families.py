"""Hugging Face MoE families both ways, against transformers' own classes: a small random Mixtral, Qwen2-MoE
(shared expert with its sigmoid gate, q/k/v biases, a dense first layer) and Qwen3-MoE (q/k norms, MoE on every
second layer) made in the test -> `tessera ckpt import-hf` -> Tessera's logits equal transformers'; and a random
Tessera model of each family -> `export_hf` -> transformers loads it and its logits equal Tessera's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from framework.base.errors import CheckpointError
from framework.checkpoint.hf import (
    check_exportable,
    config_from_hf,
    export_hf,
    load_model,
    resolve_checkpoint,
    save_model_only,
)
from framework.cli import main
from models.config import model_config
from models.decoder import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

_SHAPE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
              max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=40, num_local_experts=4,
                                      num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1e6})),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                                         norm_topk_prob=False, qkv_bias=True, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=24,
                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                                         decoder_sparse_step=2, tie_word_embeddings=True)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every tensor random (norm weights around 1, biases and routing biases included): a name mapped to the
    wrong place, or a permutation left out, changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "inv_freq" in name or "rope" in name:
                continue
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise if "gate" in name or "router" in name
                    else 0.08 * noise)


def _hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_SHAPE, **extra})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _randomize(model, seed)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_model_imports_with_equal_logits(tmp_path: Path, family: str) -> None:
    hf = _hf_model(family)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    ours, _ = load_model(resolve_checkpoint(tmp_path / "run"))
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens()), hf(_tokens()).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tessera_model_exports_and_transformers_matches(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    cfg = config_from_hf(_hf_model(family).config.to_dict())
    assert check_exportable(cfg) == family
    model = build_model(cfg, seed=1, device="cpu").eval()
    _randomize(model, seed=2)
    if family == "qwen2_moe":  # a non-zero routing bias has no place in Qwen2-MoE: refused by name
        model.layers["1"].feed_forward.router.expert_bias.fill_(0.5)
        save_model_only(model, tmp_path / "biased", "test")
        with pytest.raises(CheckpointError, match=r"layers\.1\.feed_forward\.router\.expert_bias"):
            export_hf(tmp_path / "biased", tmp_path / "refused")
    for block in model.layers.values():  # the router bias is DeepSeek-V3's only
        if hasattr(block.feed_forward, "router"):
            block.feed_forward.router.expert_bias.zero_()
    save_model_only(model, tmp_path / "run", "test")
    export_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == FAMILIES[family][0].replace("Config", "ForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(hf(_tokens()).logits, model(_tokens()), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("family", "change", "field"), [
    ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 36}, "shared_expert_intermediate_size"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ("mixtral", {"sliding_window": 4096}, "sliding_window"),
])
def test_import_refuses_fields_it_cannot_carry_by_name(family: str, change: dict[str, Any], field: str) -> None:
    hf = {**_hf_model(family).config.to_dict(), **change}
    with pytest.raises(CheckpointError, match=field):
        config_from_hf(hf)


def test_deepseek_v3_is_refused_for_its_attention_both_ways() -> None:
    from transformers import DeepseekV3Config

    with pytest.raises(CheckpointError, match="multi-head latent attention"):
        config_from_hf(DeepseekV3Config(**_SHAPE, num_hidden_layers=2).to_dict())
    cfg = model_config("test-moe", moe=dict(n_experts=8, top_k=2, expert_hidden=32, router="sigmoid",
                                            n_groups=4, topk_groups=2, n_shared_experts=1, routed_scale=2.5))
    with pytest.raises(CheckpointError, match=r"deepseek_v3, refuses: model\.attention="):
        check_exportable(cfg)
