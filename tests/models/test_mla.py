"""Multi-head latent attention against transformers' DeepseekV3 (an independent implementation of the paper):
a small random DeepseekV3 model whose layers all keep a dense MLP, its weights copied into Tessera's decoder by
name, logits within 1e-4; with and without query compression, and with YaRN's mscale folded into the softmax
scale as DeepSeek-V3 ships it. Plus the config checks and the parameter count."""

from __future__ import annotations

import pytest
import torch

from framework.base.errors import ConfigError
from models import build_model, model_config, param_counts

transformers = pytest.importorskip("transformers")

# Tessera name -> DeepseekV3 name inside a layer (the MLA names are the same on both sides).
BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def _hf_name(name: str) -> str:
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, rest = name.split(".", 2)
    rest = BLOCK_NAMES.get(rest, rest.replace("attention.", "self_attn."))
    return f"model.layers.{layer}.{rest}"


def _pair(q_lora_rank: int, yarn: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": 10000.0}
    scaling: dict[str, object] = {}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        scaling = {"rope_scaling": dict(type="yarn", factor=4.0, original_max_seq_len=64, mscale=1.0,
                                        mscale_all_dim=1.0)}
    cfg = model_config("test-mla", norm_eps=1e-6, mla=dict(q_lora_rank=q_lora_rank), **scaling)
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads, q_lora_rank=q_lora_rank or None,
        kv_lora_rank=cfg.mla.kv_lora_rank, qk_rope_head_dim=cfg.mla.qk_rope_head_dim,
        qk_nope_head_dim=cfg.mla.qk_nope_head_dim, v_head_dim=cfg.mla.v_head_dim, first_k_dense_replace=cfg.n_layers,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len, rope_parameters=rope, rope_interleave=True,
        attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    ours = build_model(cfg, seed=5).eval()
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            hf_params.pop(_hf_name(name)).copy_(p)
    assert not hf_params, f"DeepseekV3 parameters without a Tessera counterpart: {sorted(hf_params)}"
    return ours, hf


@pytest.mark.parametrize(("q_lora_rank", "yarn"), [(32, False), (0, False), (32, True)])
def test_logits_match_transformers_deepseek_v3(q_lora_rank: int, yarn: bool) -> None:
    ours, hf = _pair(q_lora_rank, yarn)
    x = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(x), hf(x).logits
    assert want.abs().max() > 0.1  # random weights give logits of this size; a zero model would prove nothing
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_param_counts_match_module() -> None:
    for q_lora_rank, mtp_depth in ((0, 0), (32, 2)):
        cfg = model_config("test-mla", mla=dict(q_lora_rank=q_lora_rank), mtp_depth=mtp_depth)
        model = build_model(cfg, device="meta")
        assert param_counts(cfg).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("overrides", "match"), [
    ({"n_kv_heads": 2}, "n_kv_heads=2 with model.attention=mla"),
    ({"mla": {"qk_rope_head_dim": 7}}, "qk_rope_head_dim=7 must be even"),
    ({"mla": {"kv_lora_rank": 0}}, "kv_lora_rank=0 must be >= 1"),
    ({"mtp_depth": -1}, "mtp_depth=-1"),
])
def test_config_refuses_what_mla_cannot_build(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        model_config("test-mla", **overrides)


def test_document_mask_equals_each_document_alone() -> None:
    """Two documents packed in one row under a document mask: every token's logits equal those of its document
    run alone (RoPE sees only relative positions, so the second document's offset does not matter)."""
    cfg = model_config("test-mla", rope_scaling=dict(type="yarn", factor=4.0, original_max_seq_len=16,
                                                     mscale=1.0, mscale_all_dim=1.0))
    model = build_model(cfg, seed=3).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    doc = torch.zeros_like(x)
    doc[0, 10:], doc[1, 17:] = 1, 1
    with torch.no_grad():
        packed = model(x, doc_ids=doc)
        for row, cut in ((0, 10), (1, 17)):
            torch.testing.assert_close(packed[row, :cut], model(x[row:row + 1, :cut])[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(packed[row, cut:], model(x[row:row + 1, cut:])[0], atol=1e-5, rtol=0)


def test_attention_is_eligible_for_the_flash_kernel() -> None:
    """Values are padded to the query/key head dim, so the flash kernel (which takes one head dim) runs MLA; with
    unequal dims SDPA has no flash kernel and only the math one, which holds the whole score matrix."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = model_config("test-mla")
    assert cfg.mla.v_head_dim != cfg.mla.qk_head_dim
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (1, 16))
    with sdpa_kernel(SDPBackend.MATH):
        want = model(x)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)


def test_flops_terms_equal_counted_kernels() -> None:
    """The planner's MLA FLOPs (models/flops.py) against torch's FlopCounterMode over a forward and backward:
    every projection's matmuls are 6 x (parameters without the norms) per token exactly; the attention core the
    kernels execute (`executed=True`, the planner's step time) equals the counted bmm FLOPs, and the model's
    count (the MFU convention) is that times (qk + v) / 2 qk: the values are zero-padded to the key dim."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from models.flops import flops_per_token

    cfg = model_config("test-mla")
    model = build_model(cfg)
    b, s = 2, 64
    x = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    pc = param_counts(cfg)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert counts["aten.mm"] == 6 * (pc.active_non_embedding - norms) * b * s
    m = cfg.mla
    core = (flops_per_token(cfg, s) - 6 * pc.active_non_embedding) * b * s
    assert counts["aten.bmm"] == core * 2 * m.qk_head_dim / (m.qk_head_dim + m.v_head_dim)
    assert counts["aten.bmm"] == (flops_per_token(cfg, s, executed=True) - 6 * pc.active_non_embedding) * b * s
