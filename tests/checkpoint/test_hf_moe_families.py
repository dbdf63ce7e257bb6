"""Hugging Face MoE families both ways, against transformers' own classes: a small random Mixtral, Qwen2-MoE
(shared expert with its sigmoid gate, q/k/v biases, a dense first layer), Qwen3-MoE (q/k norms, MoE on every
second layer) and DeepSeek-V3 (multi-head latent attention, sigmoid router with its correction bias limited to 2
of 4 expert groups, routed scale, shared expert, a dense first layer, YaRN) made in the test -> `tessera ckpt
import-hf` -> Tessera's logits equal transformers'; and a random Tessera model of each family -> `export_hf` ->
transformers loads it and its logits equal Tessera's. DeepSeek-V3's multi-token prediction layer is checked against
transformers' own MTP model (`MtpModel`), which loads it from the exported directory."""

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
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=12, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 16})),
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


def _hf_model(family: str, seed: int = 0, **change: Any) -> torch.nn.Module:
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_SHAPE, **extra, **change})
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
        if hasattr(block.feed_forward, "router") and family != "deepseek_v3":
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


def test_deepseek_v3_rope_interleave_false_imports_with_equal_logits(tmp_path: Path) -> None:
    """Rotary rows stored in halves (rope_interleave=false) are permuted to Tessera's pairs on import."""
    hf = _hf_model("deepseek_v3", seed=3, rope_interleave=False, q_lora_rank=None)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    ours, _ = load_model(resolve_checkpoint(tmp_path / "run"))
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens()), hf(_tokens()).logits, atol=1e-4, rtol=0)


def test_deepseek_v3_mtp_layer_exports_where_deepseek_keeps_it(tmp_path: Path) -> None:
    """MTP depth 1 -> layer n_layers of the HF directory: transformers' DeepseekV3ForCausalLM skips it (main
    logits equal), transformers' MtpModel loads it and drafts the logits Tessera's depth 1 computes, and import-hf
    reads it back into the same Tessera state."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    cfg = model_config("test-deepseek-v3", vocab_size=96, mtp_depth=1)
    model = build_model(cfg, seed=1, device="cpu").eval()
    _randomize(model, seed=4)
    save_model_only(model, tmp_path / "run", "test")
    export_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    # transformers finds the MTP tensors by DeepSeek-V3's layer number (61, `_keys_to_ignore_on_load_unexpected`);
    # this model's MTP layer is 3, the layer after its last
    hf._keys_to_ignore_on_load_unexpected = {r"model\.layers\.3\..*"}
    mtp = MtpModel.from_pretrained(hf).float().eval()
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=0)
        h0 = model.norm(_last_block_output(model, x))  # depth 1 reads the final-normed hidden state
        depth = model.mtp.depths["1"]
        nxt = torch.roll(x, -1, dims=1)  # the token after each position (the last column is not compared)
        ours = model.output(depth.norm(depth(h0, model.tok_embeddings(nxt), model.rope[: x.shape[1]], None)))
        theirs = mtp._project_to_logits(mtp.forward_layer(
            0, h0, torch.arange(x.shape[1]).expand(x.shape[0], -1), None, input_ids=nxt))
    torch.testing.assert_close(ours[:, :-1], theirs[:, :-1], atol=1e-4, rtol=0)
    assert main(["ckpt", "import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back, _ = load_model(resolve_checkpoint(tmp_path / "back"))
    want = model.state_dict()
    assert back.cfg.mtp_depth == 1 and set(back.state_dict()) == set(want)
    for name, tensor in back.state_dict().items():
        torch.testing.assert_close(tensor, want[name], atol=0, rtol=0, msg=name)


def _last_block_output(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = model.tok_embeddings(x)
    for block in model.layers.values():
        h = block(h, model.rope[: x.shape[1]], None)
    return h


def test_dense_mla_model_exports_as_deepseek_v3(tmp_path: Path) -> None:
    """An MLA model without experts is DeepSeek-V3 whose layers are all first dense layers."""
    from transformers import AutoModelForCausalLM

    model = build_model(model_config("test-mla", vocab_size=96, norm_eps=1e-6), seed=1, device="cpu").eval()
    _randomize(model, seed=2)
    save_model_only(model, tmp_path / "run", "test")
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert hf.config.first_k_dense_replace == hf.config.num_hidden_layers
    with torch.no_grad():
        torch.testing.assert_close(hf(_tokens()).logits, model(_tokens()), atol=1e-4, rtol=0)


def test_deepseek_v3_refuses_what_it_cannot_carry_by_name() -> None:
    hf = _hf_model("deepseek_v3").config.to_dict()
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("qk_head_dim", 99)):
        with pytest.raises(CheckpointError, match=key):
            config_from_hf({**hf, key: value})
    gqa = model_config("test-moe", moe=dict(n_experts=8, top_k=2, expert_hidden=32, router="sigmoid",
                                            n_groups=4, topk_groups=2, n_shared_experts=1, routed_scale=2.5))
    with pytest.raises(CheckpointError, match=r"deepseek_v3, refuses: model\.attention='gqa'"):
        check_exportable(gqa)
    softmax = model_config("test-deepseek-v3", moe=dict(router="softmax", n_groups=1, topk_groups=1))
    with pytest.raises(CheckpointError, match=r"model\.moe\.router='softmax'"):
        check_exportable(softmax)
