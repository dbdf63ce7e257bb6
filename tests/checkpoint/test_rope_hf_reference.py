"""RoPE scalings against transformers' own rotary embedding, on the branches the export round trip does not take:
yarn with `mscale`/`mscale_all_dim` (DeepSeek-style attention factor) and llama3/yarn configs imported without
`original_max_position_embeddings` (transformers then falls back to `max_position_embeddings`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from framework.checkpoint.hf import config_from_hf, hf_config
from models.config import ModelConfig, model_config
from models.layers import rope_tables
from models.rope import attention_factor, inv_freq

THETA = 50000.0
# transformers computes inv_freq in fp32 and the angles as fp32 products; ours are float64, cast at the end.
# inv_freq agrees to ~1 fp32 ulp (rtol 1e-6); cos/sin of angles up to 255 rad (position 255 x inv_freq <= 1)
# differ by 255 * 6e-8 ~ 2e-5 at most, so atol 1e-4. A wrong attention factor moves them by >= 1% (the
# mscale cases below differ from the plain 0.1 ln(factor) + 1 by 6-12%), far beyond.
COS_SIN_ATOL = 1e-4


def _hf_rotary(hf_dict: dict[str, Any]) -> Any:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(LlamaConfig.from_dict(hf_dict))


def _tiny(**scaling: Any) -> ModelConfig:
    return model_config("test-tiny", rope_theta=THETA, rope_scaling=scaling)


@pytest.mark.parametrize("extra", [
    {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"mscale": 0.707, "mscale_all_dim": 1.0},
    {"mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3: the two cancel, factor 1
    {"mscale": 1.0},  # mscale without mscale_all_dim: ignored, 0.1 ln(factor) + 1 (transformers' rule)
    {"attention_factor": 1.3, "mscale": 1.0, "mscale_all_dim": 0.5},  # an explicit factor wins
])
def test_yarn_mscale_cos_sin_equal_transformers(extra: dict[str, float]) -> None:
    cfg = _tiny(type="yarn", factor=4.0, original_max_seq_len=64, **extra)
    rotary = _hf_rotary(hf_config(cfg, "llama"))
    assert attention_factor(cfg.rope_scaling) == pytest.approx(rotary.attention_scaling, rel=1e-9)
    torch.testing.assert_close(rotary.inv_freq, inv_freq(cfg.head_dim, THETA, cfg.rope_scaling).float(),
                               atol=0, rtol=1e-6)
    positions = torch.arange(cfg.max_seq_len)[None]
    cos, sin = rotary(torch.zeros(1, cfg.max_seq_len, cfg.head_dim), positions)
    table = rope_tables(cfg.head_dim, cfg.max_seq_len, THETA, scaling=cfg.rope_scaling)
    half = cfg.head_dim // 2  # transformers repeats the E/2 frequencies twice (rotate_half layout)
    torch.testing.assert_close(cos[0, :, :half], table[..., 0], atol=COS_SIN_ATOL, rtol=0)
    torch.testing.assert_close(sin[0, :, :half], table[..., 1], atol=COS_SIN_ATOL, rtol=0)
    # negative control: the plain yarn factor is visibly different wherever mscale_all_dim changes it
    if "mscale_all_dim" in extra and extra["mscale"] != extra["mscale_all_dim"] and "attention_factor" not in extra:
        plain = rope_tables(cfg.head_dim, cfg.max_seq_len, THETA,
                            scaling=_tiny(type="yarn", factor=4.0, original_max_seq_len=64).rope_scaling)
        assert (plain - table).abs().max().item() > 100 * COS_SIN_ATOL


@pytest.mark.parametrize("kind, params", [
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ("yarn", {"factor": 4.0}),
])
@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_import_without_original_max_position_embeddings_follows_transformers(
        kind: str, params: dict[str, float], spelling: str) -> None:
    base = hf_config(model_config("test-tiny", rope_theta=THETA), "llama")  # max_position_embeddings=256
    base.pop("rope_scaling")
    base["rope_parameters"] = {"rope_type": "default", "rope_theta": THETA}
    if spelling == "rope_parameters":
        base["rope_parameters"] = {"rope_type": kind, "rope_theta": THETA, **params}
    else:  # transformers 4.x files
        base.pop("rope_parameters")
        base["rope_scaling"] = {"type": kind, **params}
    imported = config_from_hf(dict(base))
    assert imported.rope_scaling.type == kind
    assert imported.rope_scaling.original_max_seq_len == base["max_position_embeddings"] == 256
    rotary = _hf_rotary(base)
    ours = inv_freq(imported.head_dim, THETA, imported.rope_scaling).float()
    torch.testing.assert_close(rotary.inv_freq, ours, atol=0, rtol=1e-6)
    # negative control: a different fallback (4096, the usual pretraining length) gives other frequencies
    other = _tiny(type=kind, original_max_seq_len=4096, **params).rope_scaling
    assert not torch.allclose(inv_freq(imported.head_dim, THETA, other).float(), ours, rtol=1e-3)


def test_frequencies_are_made_on_the_requested_device() -> None:
    # the meta device stands for an accelerator here: a table built on the CPU and moved later would not be
    for scaling in (None, _tiny(type="yarn", factor=4.0, original_max_seq_len=64).rope_scaling,
                    _tiny(type="llama3", factor=8.0, original_max_seq_len=64).rope_scaling):
        assert inv_freq(16, THETA, scaling, torch.device("meta")).device.type == "meta"
