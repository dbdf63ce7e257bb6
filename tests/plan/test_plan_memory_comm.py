"""Per-rank parameters (against meta-device builds), ZeRO model states, bubble and communication formulas."""

from __future__ import annotations

import pytest

from framework.base.errors import ConfigError
from framework.parallel.pipeline_schedules import bubble_fraction
from framework.plan.comm import dp_comm_per_step, pp_comm_per_step, ring_factor, tp_comm_per_micro
from framework.plan.estimate import estimate
from framework.plan.hardware import get_hardware, parse_overrides
from framework.plan.layout import Layout, Precision, Workload, layout_problem
from framework.plan.memory import RankParams, layer_params, model_state_bytes, rank_params
from framework.plan.meta import meta_rank_params
from models.config import model_config
from models.flops import flops_per_token, num_params


@pytest.mark.parametrize("preset", ["test-tiny", "smoke-3m", "test-moe", "test-mla", "gpt3-175b", "deepseek-v3-671b"])
def test_layer_params_sum_to_the_model(preset: str) -> None:
    cfg = model_config(preset)
    total = sum(sum(layer_params(cfg, i)) for i in range(cfg.n_layers))
    norm = cfg.hidden * (1 if cfg.norm == "rmsnorm" else 2)
    vocab = cfg.vocab_size * cfg.hidden * (1 if cfg.tied_embeddings else 2)
    assert total + norm + vocab == num_params(cfg)


@pytest.mark.parametrize(("preset", "layout"), [
    ("test-tiny", Layout(tp=2, pp=2)),
    ("smoke-3m", Layout(tp=2, pp=2, virtual=2, schedule="ZBVZeroBubble")),  # tied: both ends on rank 0
    ("test-moe", Layout(tp=2, pp=2, ep=2)),
    ("test-mla", Layout(tp=2, pp=2)),  # MLA: latent down-projections and norms replicated over tp
    ("gpt3-175b", Layout(tp=8, pp=8, virtual=3, schedule="Interleaved1F1B")),
    ("llama3-405b", Layout(tp=8, pp=9, virtual=2, schedule="Interleaved1F1B")),
    ("deepseek-v3-671b", Layout(tp=4, pp=1, ep=8)),
])
def test_rank_params_match_meta_device_build(preset: str, layout: Layout) -> None:
    cfg = model_config(preset)
    counted = meta_rank_params(cfg, layout)
    assert counted == [rank_params(cfg, layout, r).total for r in range(layout.pp)]
    if not cfg.tied_embeddings and layout.ep == 1:
        assert sum(counted) * layout.tp >= num_params(cfg)  # replicated norms/biases are counted on every tp rank


def test_zero_stages_reproduce_the_zero_paper() -> None:
    # Rajbhandari et al. 2020 with 2-byte params and grads, 12 bytes of fp32 master + Adam states:
    # 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
    psi, n = 1_000_000, 8
    params = RankParams(dense=psi, experts=0, largest_layer=0, layers=())
    paper = Precision(param=2, master=4, grad=2, optimizer=8)
    expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    for z, want in expected.items():
        got = sum(model_state_bytes(params, Layout(dp=n, zero_stage=z), paper).values())
        assert got == pytest.approx(want)
    # Experts shard over the data ranks outside ep: dp x tp / ep.
    ex = RankParams(dense=0, experts=psi, largest_layer=0, layers=())
    got = model_state_bytes(ex, Layout(tp=2, dp=8, ep=4, zero_stage=3), paper)
    assert sum(got.values()) == pytest.approx(16 * psi / 4)


def test_bubble_fractions() -> None:
    assert bubble_fraction("1F1B", 1, 8) == 0.0
    assert bubble_fraction("1F1B", 4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("GPipe", 8, 8) == pytest.approx(7 / 15)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("InterleavedZeroBubble", 4, 8, 2) == pytest.approx(3 / 51)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == pytest.approx(3 / 51)
    with pytest.raises(ValueError):
        bubble_fraction("Nope", 2, 2)


def test_communication_volumes() -> None:
    assert ring_factor("all_reduce", 4) == 1.5 and ring_factor("all_gather", 4) == 0.75
    assert ring_factor("all_to_all", 1) == 0.0
    hw = get_hardware("h100-80g")
    cfg = model_config("llama3-8b")
    work = Workload(cfg, 4096, 64)
    psi = 1_000_000
    params = RankParams(dense=psi, experts=0, largest_layer=psi, layers=(0,))
    n = 8
    ring = (n - 1) / n
    # ZeRO paper: stages 0-2 move 2Ψ per step, stage 3 3Ψ (here in bytes: grads fp32, params bf16), m = 2.
    lay = Layout(dp=n, zero_stage=0, micro_batch=4)
    dp = dp_comm_per_step(work, lay, hw, params)
    assert dp["reduce"].wire_bytes == pytest.approx(2 * ring * psi * 4) and dp["gather"].wire_bytes == 0
    dp = dp_comm_per_step(work, Layout(dp=n, zero_stage=1, micro_batch=4), hw, params)
    assert dp["reduce"].wire_bytes == pytest.approx(ring * psi * 4)
    assert dp["gather"].wire_bytes == pytest.approx(ring * psi * 2)
    dp = dp_comm_per_step(work, Layout(dp=n, zero_stage=3, micro_batch=4), hw, params)
    assert dp["reduce"].wire_bytes == pytest.approx(2 * ring * psi * 4)  # every micro-batch
    # forward and backward, but the last block once (tests/plan/test_plan_comm_hand)
    d, layer = 4096, 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    root = 2 * 128256 * d + d
    assert dp["gather"].wire_bytes == pytest.approx(2 * (2 * root + 63 * layer) / (root + 32 * layer) * ring * psi
                                                    * 2)
    # TP with SP: 8 collectives of s·b·h bf16 per layer, 4 more under recompute.
    tp = tp_comm_per_micro(work, Layout(tp=8, micro_batch=1), hw, n_layers=2)
    assert tp.wire_bytes == pytest.approx(2 * 8 * (7 / 8) * 4096 * 4096 * 2)
    assert tp_comm_per_micro(work, Layout(tp=8, recompute="full"), hw, 1).messages == 12
    assert tp_comm_per_micro(work, Layout(tp=8, recompute="selective"), hw, 1).messages == 10
    pp = pp_comm_per_step(work, Layout(tp=8, pp=4, dp=2, micro_batch=1), hw)
    assert pp.wire_bytes == pytest.approx(2 * 32 * 4096 * 4096 * 2 / 8)  # 32 micro-batches, fwd + bwd


def test_estimate_hand_computed_single_gpu() -> None:
    hw = get_hardware("h100-80g", {"mm_efficiency": "0.5"})
    cfg = model_config("llama-1b")
    work = Workload(cfg, 2048, 8)
    est = estimate(work, Layout(micro_batch=2, zero_stage=0), hw)
    compute = flops_per_token(cfg, 2048) * 2048 * 8 / (989e12 * 0.5)
    assert est.time["compute"] == pytest.approx(compute)
    assert est.step_s == pytest.approx(compute + est.time["optimizer"])
    assert est.mfu == pytest.approx(0.5 * compute / est.step_s)
    assert est.hfu == est.mfu and est.bubble == 0.0


def test_layout_problems_and_hardware_overrides() -> None:
    hw = get_hardware("a100-80g", parse_overrides(["ib_gbps=12.5", "gpus_per_node=4"]))
    assert hw.ib_gbps == 12.5 and hw.gpus_per_node == 4
    work = Workload(model_config("llama3-8b"), 4096, 64)
    assert "exceeds the 4 GPUs" in str(layout_problem(work, Layout(tp=8), hw))
    big_node = get_hardware("h200", {"gpus_per_node": "16"})
    assert "does not divide model.n_kv_heads" in str(layout_problem(work, Layout(tp=16), big_node))
    assert "n_layers=32" in str(layout_problem(work, Layout(pp=3), hw))
    assert "1F1B needs at least parallel.pp = 4" in str(layout_problem(work, Layout(pp=4, dp=32, micro_batch=1), hw))
    dualpipe = Layout(pp=4, dp=16, micro_batch=1, schedule="DualPipeV", virtual=2)  # m = 4 < 2 x pp
    assert "DualPipeV needs at least 2 x parallel.pp" in str(layout_problem(work, dualpipe, hw))
    assert "virtual=2" in str(layout_problem(work, Layout(pp=2, schedule="ZBVZeroBubble"), hw))
    assert layout_problem(work, Layout(tp=4, pp=2, dp=2, micro_batch=2), hw) is None
    with pytest.raises(ConfigError, match="not in the hardware table"):
        get_hardware("tpu-v5")
    with pytest.raises(ConfigError, match="unknown field"):
        get_hardware("h200", {"bogus": "1"})
    with pytest.raises(ConfigError, match="field=value"):
        parse_overrides(["ib_gbps"])
