"""Activation formulas: hand-computed values, and byte-exact agreement with saved-tensor measurements on CPU."""

from __future__ import annotations

import pytest
import torch

from bench.plan_measure import hooked_saved_bytes, layer_saved_bytes, model_saved_bytes
from framework.parallel.pipeline_schedules import in_flight_factor
from framework.plan.activations import (
    embedding_bytes,
    head_bytes,
    korthikanti_layer_bytes,
    tessera_layer_bytes,
    tessera_layer_terms,
)
from framework.plan.memory import moe_layer_extra_bytes
from models.config import model_config
from models.decoder import build_model


def test_tessera_block_hand_computed() -> None:
    # test-tiny: h=64, a=4 (kv 2), f=128; s=32, b=2, fp32. No recompute, flash kernel:
    # 8 sbh (norm inputs/normalized/outputs x2, q, out) + 2 sb·kv·e (k and v at their 2 heads: SDPA's GQA reads
    # them in place) + 4 sbf (SwiGLU) elements of 4 bytes, 2 sb fp32 rstd, a·s·b fp32 logsumexp.
    cfg = model_config("test-tiny")
    sbh, sbf, sb = 32 * 2 * 64, 32 * 2 * 128, 32 * 2
    sbkv = sbh // 2
    assert tessera_layer_bytes(cfg, 32, 2, act_bytes=4) == 4 * (8 * sbh + 2 * sbkv + 4 * sbf + 2 * sb + 4 * sb)
    # math SDPA: scaled q and k, v, a fresh output copy for wo (4 sbh as with flash), and the s x s
    # probabilities a·s·s·b instead of the logsumexp.
    assert tessera_layer_bytes(cfg, 32, 2, act_bytes=4, kernel="math") == 4 * (
        10 * sbh + 4 * sbf + 2 * sb + 4 * 32 * 32 * 2)
    # selective: block input, wq, wk (kv 32 wide), wv, sdpa out + lse, wo out, w1 out, w3 out, w2 out.
    assert tessera_layer_bytes(cfg, 32, 2, act_bytes=4, recompute="selective") == 4 * (
        sbh + sbh + 2 * 32 * 2 * 32 + sbh + 4 * sb + sbh + 2 * sbf + sbh)
    # selective with the math kernel: the two bmm outputs (fp32 scores a·s·s·b and probs·v) replace sdpa out + lse.
    assert tessera_layer_bytes(cfg, 32, 2, act_bytes=4, recompute="selective", kernel="math") == 4 * (
        sbh + sbh + 2 * 32 * 2 * 32 + 4 * 32 * 32 * 2 + sbh + sbh + 2 * sbf + sbh)
    assert tessera_layer_bytes(cfg, 32, 2, act_bytes=4, recompute="full") == 4 * sbh
    # bf16: the norm keeps an fp32 upcast of its input, the rest is 2 bytes.
    assert tessera_layer_bytes(cfg, 32, 2, act_bytes=2) == 2 * 4 * sbh + 2 * (6 * sbh + 2 * sbkv + 4 * sbf) + 4 * (
        2 * sb + 4 * sb)


def test_tessera_block_tp_sp() -> None:
    cfg = model_config("llama3-8b")  # h 4096, a 32, kv 8, f 14336
    s, b, t = 4096, 1, 8
    sbh = s * b * 4096
    sb, sbf_t, sbh_t = s * b, s * b * 14336 // t, sbh // t
    # bf16 (2 bytes). Per norm: fp32 input 4 sbh + fp32 rstd 4 sb + normalized 2 sbh; the gathered inputs of the
    # column-parallel projections 2 sbh each; q, out 2 sbh/t each; k, v 2 sb·kv/t each (kv 1024 wide: SDPA's GQA);
    # logsumexp 4 (a/t) sb; SwiGLU 4 x 2 sbf/t.
    sbkv_t = s * b * 1024 // t
    tail = 2 * 2 * sbh_t + 2 * 2 * sbkv_t + 4 * (32 // t) * sb + 4 * 2 * sbf_t + 2 * 2 * sbh
    assert tessera_layer_bytes(cfg, s, b, tp=t) == 2 * (4 * sbh + 4 * sb + 2 * sbh) + tail
    # sequence parallel shards only the norm region.
    assert tessera_layer_bytes(cfg, s, b, tp=t, sp=True) == 2 * (4 * sbh_t + 4 * sb // t + 2 * sbh_t) + tail
    assert tessera_layer_bytes(cfg, s, b, tp=t, sp=True, recompute="full") == 2 * sbh // t
    # selective under TP + SP: input/t, wq/t, wk+wv (kv 1024 wide)/t, out/t, lse, wo full, w1+w3/t, w2 full, 2 RS/t.
    kv = s * b * 1024 // t
    assert tessera_layer_bytes(cfg, s, b, tp=t, sp=True, recompute="selective") == 2 * (
        sbh_t + sbh_t + 2 * kv + sbh_t + sbh + 2 * sbf_t + sbh + 2 * sbh_t) + 4 * (32 // t) * sb
    names = [term.name for term in tessera_layer_terms(cfg, s, b)]
    assert "attention.logsumexp" in names and "attention.probs" not in names


def test_korthikanti_gpt3_hand_computed() -> None:
    sbh = 2048 * 1 * 12288
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == sbh * (34 + 5 * 96 * 2048 / 12288)  # 114 sbh
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 2_868_903_936
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, tp=8, sp=True) == 358_612_992  # sbh (34/8 + 80/8)
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, tp=8) == sbh * (10 + 3 + 10)
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, tp=8, sp=True, recompute="selective") == sbh * 34 / 8
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, tp=8, sp=True, recompute="full") == 2 * sbh / 8


def test_in_flight_factor() -> None:
    assert in_flight_factor("1F1B", 1, 8) == 1.0
    assert in_flight_factor("1F1B", 4, 8) == 1.0
    assert in_flight_factor("1F1B", 4, 2) == 0.5
    assert in_flight_factor("GPipe", 4, 8) == 2.0
    assert in_flight_factor("Interleaved1F1B", 4, 8, 2) == 1 + 3 / 8  # Korthikanti: 1 + (p-1)/(p v)
    # torch's warm-up is capped at every forward of the step: at m = p all m·v chunk forwards, L layers' worth
    assert in_flight_factor("Interleaved1F1B", 8, 8, 2) == 1.0
    assert in_flight_factor("Interleaved1F1B", 4, 16, 2) == (4 + 6 + 1) / 8  # two rounds of p: Korthikanti again
    assert in_flight_factor("Interleaved1F1B", 8, 8, 2, rank=7) == (8 + 0 + 1) / 16  # the last rank warms up least
    assert in_flight_factor("DualPipeV", 4, 8) == 9 / 8  # 2p + 1 chunk forwards (torch's table)


MLA = {"preset": "test-mla"}  # multi-head latent attention (models/mla.py), with query compression and without


@pytest.mark.parametrize("shape", [{}, {"n_kv_heads": 4}, {"mlp": "gelu", "norm": "layernorm"}, MLA,
                                   {**MLA, "mla": {"q_lora_rank": 0}}])
def test_formula_matches_saved_tensors_exactly(shape: dict[str, object]) -> None:
    torch.set_num_threads(1)
    shape = dict(shape)
    cfg = model_config(str(shape.pop("preset", "test-tiny")), **shape)
    model = build_model(cfg)
    b, s = 2, 32
    for recompute in ("none", "selective", "full"):
        for kernel in ("flash", "math"):
            x = torch.randn(b, s, cfg.hidden, requires_grad=True)
            measured, by_op = layer_saved_bytes(model.layers["0"], model.rope, x, recompute=recompute,
                                                kernel=kernel)
            predicted = tessera_layer_bytes(cfg, s, b, recompute=recompute, act_bytes=4, kernel=kernel)
            assert measured == predicted, (recompute, kernel, by_op)


def test_saved_tensor_hooks_agree_without_recompute() -> None:
    # The hook-based count (what autograd packs) equals the liveness count and the formula.
    torch.set_num_threads(1)
    cfg = model_config("test-tiny")
    model = build_model(cfg)
    x = torch.randn(2, 32, cfg.hidden, requires_grad=True)
    block = model.layers["0"]
    hooked = hooked_saved_bytes(block, lambda: block(x, model.rope), static=(model.rope,))
    # Both count the block input x: the first norm saves it.
    assert hooked == layer_saved_bytes(block, model.rope, x)[0] == tessera_layer_bytes(cfg, 32, 2, act_bytes=4)


def test_head_bytes_formula() -> None:
    cfg = model_config("test-tiny")
    rows = 32 * 2
    assert head_bytes(cfg, 32, 2, act_bytes=4) == 4 * (3 * rows * 64 + rows + rows * 512) + 8 * rows + 4


@pytest.mark.parametrize("preset", ["test-tiny", "smoke-3m"])
def test_whole_model_forward_matches_exactly(preset: str) -> None:
    torch.set_num_threads(1)
    cfg = model_config(preset)
    model = build_model(cfg)
    b, s = 2, 64
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1))
    measured, by_op = model_saved_bytes(model, tokens)
    predicted = (cfg.n_layers * tessera_layer_bytes(cfg, s, b, act_bytes=4) + head_bytes(cfg, s, b, act_bytes=4)
                 + embedding_bytes(s, b))
    assert measured == predicted, by_op


@pytest.mark.parametrize("preset", ["test-tiny", "test-mla"])
def test_bf16_block_matches_saved_tensors(preset: str) -> None:
    # 16-bit activations: the RMSNorm keeps an fp32 upcast of its input and fp32 rstd; the math kernel is fp32.
    torch.set_num_threads(1)
    cfg = model_config(preset)
    model = build_model(cfg).to(torch.bfloat16)
    for recompute in ("none", "selective"):
        for kernel in ("flash", "math"):
            x = torch.randn(2, 32, cfg.hidden, requires_grad=True, dtype=torch.bfloat16)
            measured, by_op = layer_saved_bytes(model.layers["0"], model.rope, x, recompute=recompute,
                                                kernel=kernel)
            assert measured == tessera_layer_bytes(cfg, 32, 2, recompute=recompute, act_bytes=2, kernel=kernel), by_op


@pytest.mark.parametrize("moe", [{}, {"n_experts": 8, "top_k": 2, "expert_hidden": 64, "n_shared_experts": 1}])
def test_moe_layer_within_one_percent(moe: dict[str, object]) -> None:
    torch.set_num_threads(1)
    cfg = model_config("test-moe", **({"moe": moe} if moe else {}))
    model = build_model(cfg)
    x = torch.randn(2, 64, cfg.hidden, requires_grad=True)
    measured, by_op = layer_saved_bytes(model.layers["0"], model.rope, x)
    predicted = tessera_layer_bytes(cfg, 64, 2, act_bytes=4) + moe_layer_extra_bytes(cfg, 64, 2, 1, 4)
    assert measured == pytest.approx(predicted, rel=0.01), by_op
