"""The planner's traffic model (framework/plan/comm.py) on the branches the other plan tests reach only through a
ratio or an inequality: hpZ's two gathers, the experts' reduction beside ZeRO++, the expert all-to-all. Every
expected value is written out by hand from what the collective moves (a ring collective over n ranks sends
(n - 1)/n of its buffer, an all-reduce twice that), not taken from the module's helpers. Exact comparisons: the
model is closed-form arithmetic on integers and powers of two (pytest.approx only absorbs float summation order).
"""

from __future__ import annotations

import pytest

from framework.plan.comm import QUANT_BLOCK, dp_comm_per_step, ep_comm_per_micro
from framework.plan.hardware import get_hardware
from framework.plan.layout import Layout, Workload
from framework.plan.memory import RankParams
from models.config import model_config

HW = get_hardware("h100-80g")
PSI = 1_000_000  # dense parameters on the rank
PSI_E = 300_000  # expert parameters on the rank


def _work(global_batch: int = 64) -> Workload:
    return Workload(model_config("llama3-8b"), 4096, global_batch)


def test_hpz_gathers_forward_over_the_shard_group_and_backward_over_the_node() -> None:
    """ZeRO-3 with hpZ: forward's m gathers of bf16 params cross the whole shard group (n ranks); backward's m
    gathers run on the secondary shard inside the hpz group. One message per layer per gather each."""
    n, m, layers = 16, 4, 3  # dp=16, micro_batch 1 with global batch 64 -> 4 micro-batches per rank
    params = RankParams(dense=PSI, experts=0, largest_layer=PSI, layers=(0, 1, 2))
    for hpz in (2, 8):  # 2: the smallest hpZ group (a `> 1` bound moved to `> 2` would take the plain path)
        lay = Layout(dp=n, zero_stage=3, micro_batch=16, hpz=hpz)
        dp = dp_comm_per_step(_work(1024), lay, HW, params)
        cross = m * (n - 1) / n * PSI * 2
        node = m * (hpz - 1) / hpz * PSI * 2
        assert dp["gather"].wire_bytes == pytest.approx(cross + node, rel=1e-12)
        assert dp["gather"].messages == 2 * m * layers  # m forward + m backward gathers per layer
        # control: without hpZ both gathers cross the shard group (the formula above is not the plain one)
        plain = dp_comm_per_step(_work(1024), Layout(dp=n, zero_stage=3, micro_batch=16), HW, params)
        assert plain["gather"].wire_bytes == pytest.approx(_zero3_gathers_per_element(m) * (n - 1) / n * PSI * 2,
                                                           rel=1e-12)
        assert dp["gather"].seconds < plain["gather"].seconds


def _zero3_gathers_per_element(m: int) -> float:
    """ZeRO-3 without pp on Llama-3-8B's 32 layers, by unit: every micro-batch gathers each block and the root's
    own parameters (embedding, final norm, head) for its forward and again for its backward, except the last
    block (kept gathered from forward to backward, zero.py); as a multiple of the rank's parameters."""
    d, q, kv, ffn, vocab = 4096, 32 * 128, 8 * 128, 14336, 128256
    layer = 2 * q * d + 2 * kv * d + 3 * d * ffn + 2 * d
    root = 2 * vocab * d + d
    return m * (2 * root + 31 * 2 * layer + layer) / (root + 32 * layer)


def test_zero3_under_pp_gathers_in_the_schedules_order_and_reduces_once() -> None:
    """ZeRO-3 on PP2 1F1B, 4 micro-batches, Llama-3-8B's 32 layers (16 per stage): a forward gathers what is
    resharded and reshards every block but the stage's last; a backward gathers what is resharded and, under pp,
    leaves everything gathered until the stage's reduction after its last backward (torch's PipelineStage). Stage 0
    runs F F B F B F B B: 16 blocks + root at the first forward, 15 at the second, 15 at the first backward, none
    at the third forward (all gathered) but resharded after it, 15 at the second backward, and so on — each
    resharding block 5 times, the last block and the root once. The gradients are reduce-scattered once per step."""
    d, q, kv, ffn, vocab = 4096, 32 * 128, 8 * 128, 14336, 128256
    layer = 2 * q * d + 2 * kv * d + 3 * d * ffn + 2 * d
    n, m = 8, 4
    lay = Layout(pp=2, dp=n, zero_stage=3, micro_batch=2)
    work = _work(64)
    for rank, root in ((0, vocab * d), (1, vocab * d + d)):
        total = root + 16 * layer
        params = RankParams(dense=total, experts=0, largest_layer=layer, layers=tuple(range(16 * rank, 16 * rank + 16)))
        dp = dp_comm_per_step(work, lay, HW, params, rank)
        resharding = 5 if rank == 0 else m + 1  # stage 1 runs F B F B F B F B: the first F, then every B
        gathered = resharding * 15 * layer + layer + root
        assert dp["gather"].wire_bytes == pytest.approx((n - 1) / n * gathered * 2, rel=1e-12), rank
        assert dp["gather"].messages == resharding * 15 + 1
        assert dp["reduce"].wire_bytes == pytest.approx((n - 1) / n * total * 4, rel=1e-12)
    # ZeRO-2 under pp reduces once too (without pp: every micro-batch)
    z2 = dp_comm_per_step(work, Layout(pp=2, dp=n, zero_stage=2, micro_batch=2), HW, params, 1)
    assert z2["reduce"].wire_bytes == pytest.approx((n - 1) / n * total * 4, rel=1e-12)
    flat = dp_comm_per_step(work, Layout(pp=1, dp=n, zero_stage=2, micro_batch=2), HW, params, 0)
    assert flat["reduce"].wire_bytes == pytest.approx(m * (n - 1) / n * total * 4, rel=1e-12)


def test_zeropp_leaves_the_experts_reduction_plain() -> None:
    """qgZ quantizes the dense gradients' reduce-scatter only: the experts' gradients (their own edp group,
    dp*tp/ep ranks) are reduce-scattered in fp32 as without ZeRO++."""
    n, ep = 8, 4
    params = RankParams(dense=PSI, experts=PSI_E, largest_layer=PSI, layers=(0,), n_moe=1)
    lay = Layout(dp=n, ep=ep, zero_stage=1, micro_batch=8, qgz=True)
    dp = dp_comm_per_step(_work(), lay, HW, params)
    q = 1 + 4 / QUANT_BLOCK  # int8 values plus one fp32 scale per block
    edp = n // ep
    dense = (n - 1) / n * PSI * q
    experts = (edp - 1) / edp * PSI_E * 4
    assert dp["reduce"].wire_bytes == pytest.approx(dense + experts, rel=1e-12)
    # the experts' gather is plain bf16 too (qwZ is off here; ZeRO-1 gathers the updated shards once)
    assert dp["gather"].wire_bytes == pytest.approx((n - 1) / n * PSI * 2 + (edp - 1) / edp * PSI_E * 2, rel=1e-12)


def test_expert_all_to_all_bytes_by_hand() -> None:
    """Four all-to-alls per MoE layer (dispatch and combine, forward and backward), six under recompute; each
    moves top_k copies of this rank's tokens (hidden x bf16), times the busiest rank's imbalance, and sends
    (ep - 1)/ep of it off the rank."""
    cfg = model_config("mixtral-8x7b")
    work = Workload(cfg, 4096, 64)
    lay = Layout(tp=2, dp=8, ep=8, micro_batch=1)
    tokens = 4096 * 1 // 2  # sequence-parallel: each tp rank routes its half of the sequence
    buf = cfg.moe.top_k * tokens * cfg.hidden * 2 * work.moe_imbalance
    got = ep_comm_per_micro(work, lay, HW, n_moe_layers=3)
    assert got.wire_bytes == pytest.approx(4 * 3 * (8 - 1) / 8 * buf, rel=1e-12)
    assert got.messages == 12
    full = ep_comm_per_micro(work, Layout(tp=2, dp=8, ep=8, micro_batch=1, recompute="full"), HW, 3)
    assert full.messages == 18 and full.wire_bytes == pytest.approx(6 * 3 * (8 - 1) / 8 * buf, rel=1e-12)
    # context parallel: each cp rank routes the tokens of its share of the sequence only
    cp2 = ep_comm_per_micro(work, Layout(tp=2, cp=2, dp=8, ep=8, micro_batch=1), HW, 3)
    assert cp2.wire_bytes == pytest.approx(got.wire_bytes / 2, rel=1e-12)
    # no experts parallel, or no MoE layer: nothing moves
    assert ep_comm_per_micro(work, Layout(tp=2, dp=8, ep=1), HW, 3).wire_bytes == 0.0
    assert ep_comm_per_micro(work, lay, HW, 0).messages == 0


def test_no_data_parallelism_moves_nothing() -> None:
    """One data rank (and experts on every rank of their group): no reduction, no gather, not even a message."""
    params = RankParams(dense=PSI, experts=PSI_E, largest_layer=PSI, layers=(0,), n_moe=1)
    for zero in (0, 1, 3):
        dp = dp_comm_per_step(_work(), Layout(tp=2, dp=1, ep=2, zero_stage=zero, micro_batch=8), HW, params)
        for part in ("reduce", "gather"):
            assert (dp[part].wire_bytes, dp[part].messages, dp[part].seconds) == (0.0, 0, 0.0), (zero, part)
    # control: two data ranks do move the gradients
    assert dp_comm_per_step(_work(), Layout(dp=2, zero_stage=1, micro_batch=8), HW, params)["reduce"].messages > 0


def test_tensor_parallel_under_context_parallel_and_the_ring_latency() -> None:
    """TP's 8 collectives per layer move one cp chunk of the sequence (s/cp x b x h, bf16) each; a ring collective
    over n ranks takes n - 1 steps, each paying the link latency once, on top of bytes / bandwidth."""
    from framework.plan.comm import tp_comm_per_micro

    work = _work()
    lay = Layout(tp=4, cp=2, dp=2, micro_batch=1)
    buf = 4096 // 2 * 1 * 4096 * 2
    got = tp_comm_per_micro(work, lay, HW, n_layers=2)
    wire = 8 * 2 * (4 - 1) / 4 * buf
    assert got.wire_bytes == pytest.approx(wire, rel=1e-12) and got.messages == 16
    nvlink = HW.nvlink_gbps * 1e9 * HW.bus_efficiency  # bytes/s a GPU achieves on a ring inside the node
    assert got.seconds == pytest.approx(wire / nvlink + 16 * (4 - 1) * HW.latency_us * 1e-6, rel=1e-12)
    # control: the latency term is not negligible here (a wrong step count moves seconds beyond rel 1e-12)
    assert 16 * HW.latency_us * 1e-6 > 1e-9 * got.seconds
