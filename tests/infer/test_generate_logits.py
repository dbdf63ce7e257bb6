"""The KV cache decodes with the same logits as recomputing the whole sequence, at every step and every row.

Token ids of a near-uniform model are a weak proxy (a wrong rotary position moves the logits by ~1e-3 against
top-2 gaps of ~1e-2, so greedy ids rarely change); this compares the logits `generate` decides from.
"""

from __future__ import annotations

import pytest
import torch

import framework.infer.generate as gen_mod
from framework.infer.generate import SamplingConfig, generate
from models.config import model_config
from models.decoder import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = [[5, 17, 9, 300, 41, 7], [88], [3, 3, 3, 120]]

# fp32, hidden 64, 4 layers: the cached and the recomputed forward differ only in the order of the attention
# sums (a softmax over <= 18 keys, dot products of length 16), a few ulps of values of order 1: ~1e-6 at most.
# A position off by one or every new token at position 0 moves the logits by >= 1e-3 (measured: 1.7e-3 on
# the trained tiny model, more on this sharpened one), so 2e-5 separates the two by two orders of magnitude.
LOGIT_TOL = 2e-5


def _recorded_logits(model: torch.nn.Module, cfg: SamplingConfig,
                     monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    real = gen_mod.next_tokens

    def spy(logits_BV: torch.Tensor, c: SamplingConfig, g: torch.Generator | None) -> torch.Tensor:
        seen.append(logits_BV.detach().clone())
        return real(logits_BV, c, g)

    monkeypatch.setattr(gen_mod, "next_tokens", spy)
    generate(model, PROMPTS, cfg)  # type: ignore[arg-type]
    monkeypatch.setattr(gen_mod, "next_tokens", real)
    return seen


def _sharpened_model(preset: str = "test-tiny") -> torch.nn.Module:
    """The tiny decoder with its weights scaled up, so attention and logits are far from uniform."""
    model = build_model(model_config(preset), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(4.0 if "embeddings" not in name else 1.0)
    return model.eval()


@pytest.mark.parametrize("preset", ["test-tiny", "test-mla"])  # test-mla: MLA's compressed latent cache
def test_cached_logits_equal_recomputed_logits(monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    model = _sharpened_model(preset)
    n = 10
    cached = _recorded_logits(model, SamplingConfig(max_new_tokens=n), monkeypatch)
    full = _recorded_logits(model, SamplingConfig(max_new_tokens=n, use_cache=False), monkeypatch)
    assert len(cached) == len(full) == n
    for step, (a, b) in enumerate(zip(cached, full, strict=True)):
        assert a.shape == (len(PROMPTS), 512)
        err = (a - b).abs().max().item()
        assert err <= LOGIT_TOL, f"step {step}: cached logits differ from recomputed by {err:.2e} > {LOGIT_TOL}"

    # negative control: the same comparison sees the newest token placed at position 0 (RoPE is relative, so
    # shifting every position alike would change nothing; a wrong position for one token is what a cache bug does)
    ids = torch.tensor([PROMPTS[0]])
    right = model(ids)[:, -1]
    wrong_pos = torch.arange(ids.shape[1])[None].clone()
    wrong_pos[0, -1] = 0
    assert (right - model(ids, positions=wrong_pos)[:, -1]).abs().max().item() > 50 * LOGIT_TOL
