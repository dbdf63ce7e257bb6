"""bench/ref_llama.py, the plain-PyTorch Llama the GPU check measures Tessera's framework tax against, computes the
same function as Tessera's Decoder: loaded with a Tessera model's weights it gives the same logits (fp32, CPU),
so the tax (Tessera's step time over the reference's, bench/gpu_bench.py) compares equal work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from framework.config import load_config
from framework.testing.tiny import TINY
from models.decoder import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu_phases import reference_model


@pytest.mark.parametrize("overrides", [
    [],  # GQA (4 query heads on 2 KV heads), untied head
    ["model.n_kv_heads=4", "model.tied_embeddings=true", "model.rope_theta=500000", "model.norm_eps=1e-6"],
])
def test_reference_llama_gives_tessera_logits_for_the_same_weights(overrides: list[str]) -> None:
    cfg = load_config(TINY, overrides).model
    tessera = build_model(cfg, seed=3)
    ref = reference_model(cfg, tessera.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = tessera(tokens), ref(tokens)
    assert want.abs().max() > 0.1  # real logits, not a degenerate model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
