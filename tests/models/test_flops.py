"""The one FLOPs-per-token function and parameter counts, against hand computation and the built module."""

from __future__ import annotations

import pytest

from models import build_model, flops_per_token, model_config, num_params, param_counts


def test_flops_hand_computed_tiny() -> None:
    # vocab 100, hidden 8, 2 layers, 2 heads (head_dim 4), MHA, ffn 16, SwiGLU, untied.
    cfg = model_config(None, vocab_size=100, hidden=8, n_layers=2, n_heads=2, ffn_hidden=16, max_seq_len=32)
    attn = 4 * 8 * 8  # q, k, v, o
    mlp = 3 * 8 * 16
    norms = 2 * 8
    n_layer = attn + mlp + norms
    head = 100 * 8
    n = 2 * n_layer + 8 + head  # layers + final norm + head; no input embedding
    assert param_counts(cfg).active_non_embedding == n == 2 * (256 + 384 + 16) + 8 + 800
    seq = 32
    assert flops_per_token(cfg, seq) == 6 * n + 12 * 2 * 8 * 32
    assert flops_per_token(cfg, seq, causal=True) == 6 * n + 6 * 2 * 8 * 32
    # full recompute reruns the blocks' forward, not the head's: 8 (N - head) + 6 head.
    assert flops_per_token(cfg, seq, recompute=True) == 8 * n - 2 * head + 16 * 2 * 8 * 32


def test_llama3_8b_matches_published_count() -> None:
    cfg = model_config("llama3-8b")
    assert num_params(cfg) == 8_030_261_248  # Meta's reported parameter count
    # Common convention (torchtitan): 6 * (N - embedding) + 12 * L * h * s
    n = num_params(cfg) - 128256 * 4096
    assert flops_per_token(cfg, 8192) == 6 * n + 12 * 32 * 4096 * 8192


@pytest.mark.parametrize("preset", ["test-tiny", "smoke-3m"])
def test_counts_match_module(preset: str) -> None:
    cfg = model_config(preset)
    model = build_model(cfg)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", ["llama2-7b", "llama3-70b", "gpt3-175b", "llama3-405b", "test-qwen2-moe",
                                    "test-qwen3-moe", "test-deepseek-v3", "qwen3-30b-a3b"])
def test_counts_match_meta_module(preset: str) -> None:
    cfg = model_config(preset)
    model = build_model(cfg, device="meta")
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())


def test_gpt3_175b() -> None:
    assert abs(num_params(model_config("gpt3-175b")) / 1e9 - 175) < 0.5


def test_presets_are_listed_with_their_published_sizes(capsys) -> None:  # type: ignore[no-untyped-def]
    from framework.cli import main
    from models.config import PRESETS

    assert main(["presets"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == set(PRESETS)
    # Published sizes: Mixtral 8x7B 46.7B parameters (Jiang et al. 2024), Llama 3 8B 8.03B, GPT-3 175B.
    assert rows["mixtral-8x7b"][1] == "46.70B" and rows["mixtral-8x7b"][-3:] == ["8", "(top", "2)"]
    assert rows["llama3-8b"][1] == "8.03B" and rows["gpt3-175b"][1].startswith("175.")
    # Model cards: Mixtral 8x22B 141B; Qwen2-57B-A14B 57.41B; Qwen3-30B-A3B 30.5B; Qwen3-235B-A22B 235B.
    assert rows["mixtral-8x22b"][1] == "140.63B" and rows["qwen2-57b-a14b"][1] == "57.41B"
    assert rows["qwen3-30b-a3b"][1].startswith("30.5") and rows["qwen3-235b-a22b"][1].startswith("235.")
