"""QK-clip (MuonClip, Kimi K2 arXiv 2507.20534) in one process: against a reference written from the paper's
Algorithm 1 on MHA, the exact-tau property under GQA, a planted large logit, the guard skip and the refusals.
Multi-rank parity (TP2, DP2 ZeRO-3 with qk_clip on) is in tests/parallel/test_muon_parity.py.

The optimizer steps at lr 0, so the weights the clip rescales are the ones the maxima were measured with: the
paper's rule then says exactly what each head's weights must become."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from framework.base.errors import ConfigError
from framework.testing.tiny import tiny_config
from framework.train.local_engine import LocalEngine
from models.attention import dense_document_mask, max_logits
from models.layers import apply_rope

MUON = ["train.optimizer=muon", "train.muon.ns_dtype=fp32", "train.muon.qk_clip=true"]


def _engine(*overrides: str) -> tuple[LocalEngine, Any]:
    cfg = tiny_config(None, *MUON, *overrides)
    return LocalEngine(cfg.model, cfg.train, torch.device("cpu")), cfg


def _batch(cfg: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.model.vocab_size, (2, 2, cfg.data.seq_len + 1), generator=g)


def _attention_inputs(engine: LocalEngine, batch: torch.Tensor) -> dict[int, list[tuple[torch.Tensor, ...]]]:
    """Each layer's attention inputs (x, rope) of every micro-batch, from a plain forward."""
    seen: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    hooks = [engine.model.layers[str(i)].attention.register_forward_pre_hook(
        lambda _m, args, i=i: seen.setdefault(i, []).append((args[0].detach(), args[1])))
        for i in range(len(engine.model.layers))]
    with torch.no_grad():
        for micro in batch:
            engine.model(micro[:, :-1])
    for h in hooks:
        h.remove()
    return seen


@torch.no_grad()
def _max_logits(attn: Any, inputs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The paper's S_max^h = max over the batch and i >= j of q_i^h . k_j^h / sqrt(d), with full score matrices."""
    best = None
    for x, rope in inputs:
        b, t, _ = x.shape
        q = apply_rope(attn.wq(x).view(b, t, -1, attn.head_dim), rope)
        k = apply_rope(attn.wk(x).view(b, t, -1, attn.head_dim), rope)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        s = torch.einsum("bihe,bjhe->bhij", q, k) / attn.head_dim**0.5
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        m = s.amax(dim=(0, 2, 3))
        best = m if best is None else torch.maximum(best, m)
    assert best is not None
    return best


def _step(engine: LocalEngine, batch: torch.Tensor, apply: bool = True) -> None:
    engine.forward_backward(batch)
    engine.optimizer_step(0.0, apply=apply)


def _plant(engine: LocalEngine, layer: int, head: int, factor: float) -> None:
    attn = engine.model.layers[str(layer)].attention
    with torch.no_grad():
        attn.wq.weight[head * attn.head_dim:(head + 1) * attn.head_dim] *= factor


def test_mha_clip_follows_the_papers_algorithm() -> None:
    engine, cfg = _engine("model.n_kv_heads=4", "train.muon.qk_clip_tau=0.5")
    _plant(engine, 1, 2, 40.0)  # one head's logits far past tau
    batch = _batch(cfg)
    inputs = _attention_inputs(engine, batch)
    want: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    tau, clipped = 0.5, 0
    for i, seen in inputs.items():  # Algorithm 1: gamma = tau / S_max; W_q^h, W_k^h *= sqrt(gamma) where S > tau
        attn = engine.model.layers[str(i)].attention
        wq, wk = attn.wq.weight.detach().clone(), attn.wk.weight.detach().clone()
        for h, s in enumerate(_max_logits(attn, seen).tolist()):
            if s > tau:
                rows = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
                wq[rows] *= (tau / s) ** 0.5
                wk[rows] *= (tau / s) ** 0.5
                clipped += 1
        want[i] = (wq, wk)
    assert 0 < clipped < 4 * len(inputs)  # the planted head and some others, not all
    _step(engine, batch)
    for i, (wq, wk) in want.items():
        attn = engine.model.layers[str(i)].attention
        torch.testing.assert_close(attn.wq.weight.detach(), wq, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(attn.wk.weight.detach(), wk, rtol=1e-6, atol=1e-7)


def test_gqa_clip_brings_every_head_over_tau_to_tau() -> None:
    engine, cfg = _engine("train.muon.qk_clip_tau=0.3")  # test-tiny: 4 query heads on 2 key heads
    _plant(engine, 0, 3, 50.0)
    batch = _batch(cfg)
    inputs = _attention_inputs(engine, batch)
    before = {i: _max_logits(engine.model.layers[str(i)].attention, s) for i, s in inputs.items()}
    assert before[0][3] > 10 * 0.3 and (before[1] < 0.3).any()  # planted: far past tau; some heads under it
    _step(engine, batch)
    # each layer's logits on the inputs it clipped for (later layers' inputs move with earlier layers' weights)
    after = {i: _max_logits(engine.model.layers[str(i)].attention, s) for i, s in inputs.items()}
    for i in before:
        torch.testing.assert_close(after[i], before[i].clamp(max=0.3), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(engine.qk_clip.last_max, torch.stack([before[i] for i in sorted(before)]),
                               rtol=1e-5, atol=1e-7)


def test_max_logits_in_query_blocks_with_documents_equals_the_dense_masked_maximum() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 10, 4, 8, generator=g), torch.randn(2, 10, 2, 8, generator=g)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 2, 2]])
    s = torch.einsum("bihe,bjhe->bhij", q, k.repeat_interleave(2, dim=2)) / 8**0.5 + dense_document_mask(doc)
    torch.testing.assert_close(max_logits(q, k, doc, block=3), s.amax(dim=(0, 2, 3)))


def test_a_skipped_step_clips_nothing_and_forgets_its_maxima() -> None:
    engine, cfg = _engine("train.muon.qk_clip_tau=0.01")
    batch = _batch(cfg)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    _step(engine, batch, apply=False)
    assert all(torch.equal(p, weights[n]) for n, p in engine.model.named_parameters())
    assert all(engine.model.layers[str(i)].attention.max_logits_H is None for i in range(len(engine.model.layers)))


@pytest.mark.parametrize(("overrides", "words"), [
    (["train.optimizer=adamw"], "train.optimizer=muon"),
    (["model.preset=test-mla"], "MLA"),
    (["model.qk_norm=true"], "qk_norm"),
    (["parallel.cp=2", "data.seq_len=64"], "parallel.cp=2"),
    (["train.muon.qk_clip_tau=0"], "qk_clip_tau"),
])
def test_refused_where_it_cannot_clip(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        tiny_config(None, *MUON, *overrides)
