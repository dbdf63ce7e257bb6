"""Planner x context parallelism: activations on s/cp tokens, K/V traffic, long-context layouts."""

from __future__ import annotations

from framework.plan.activations import tessera_layer_bytes
from framework.plan.comm import cp_comm_per_micro
from framework.plan.hardware import get_hardware
from framework.plan.layout import Layout, Workload, layout_problem
from framework.plan.memory import cp_kv_bytes, layer_bytes, model_state_bytes, rank_params
from framework.plan.search import plan
from models.config import model_config

HW = get_hardware("h100-80g")
LLAMA31 = model_config("llama3.1-405b")


def test_long_context_405b_on_2048_h100_needs_cp() -> None:
    """Llama 3.1 405B at 128k on 2,048 H100s: every feasible layout splits the sequence (cp > 1)."""
    result = plan(Workload(LLAMA31, 131072, 64), 2048, HW)
    assert result.feasible, result.examples
    assert all(e.layout.cp > 1 for e in result.feasible), [e.layout.describe() for e in result.top(3)]
    best = result.feasible[0]
    assert "CP" in best.layout.describe() and best.comm["cp"].wire_bytes > 0
    # The same model at 8k still plans without cp (cp adds traffic and no saving there).
    short = plan(Workload(model_config("llama3-8b"), 8192, 512), 64, HW)
    assert short.feasible[0].layout.cp == 1


def test_activations_divide_by_cp_plus_the_gathered_kv() -> None:
    cfg, s = model_config("llama3-8b"), 32768
    work = Workload(cfg, s, 8, cp_comm="allgather")
    one = layer_bytes(work, Layout(tp=2), "none")
    assert one == tessera_layer_bytes(cfg, s, 1, tp=2, sp=True, act_bytes=2)
    for cp in (2, 4, 8):
        got = layer_bytes(work, Layout(tp=2, cp=cp), "none")
        local = tessera_layer_bytes(cfg, s // cp, 1, tp=2, sp=True, act_bytes=2)
        kv = 2 * 2 * (s - s // cp) * (cfg.n_heads // 2) * cfg.head_dim  # k and v, all keys, bf16
        assert got == local + kv == local + cp_kv_bytes(cfg, s, 1, 2, cp, 2)
        assert got < one / cp * 1.6  # the gathered K/V is what keeps it above one / cp
    # full recompute keeps only the block input: exactly 1/cp
    assert layer_bytes(work, Layout(cp=4), "full") * 4 == layer_bytes(work, Layout(), "full")
    # the ring keeps only its local K/V; all_to_all keeps the whole sequence on h/(t cp) heads, the same bytes
    # while the local KV heads (8 / 2 = 4) split over cp, and K/V repeated to the query heads past that
    for comm in ("ring", "all_to_all"):
        local = tessera_layer_bytes(cfg, s // 4, 1, tp=2, sp=True, act_bytes=2)
        assert layer_bytes(Workload(cfg, s, 8, cp_comm=comm), Layout(tp=2, cp=4), "none") == local
    repeated = 2 * 2 * s * (cfg.n_heads // 2 - cfg.kv_heads // 2) // 8 * cfg.head_dim
    assert cp_kv_bytes(cfg, s, 1, 2, 8, 2, "all_to_all") == repeated > 0


def test_kv_all_gather_traffic_and_sharded_states() -> None:
    cfg, s = LLAMA31, 131072
    work = Workload(cfg, s, 64)
    c = cp_comm_per_micro(work, Layout(tp=8, cp=16), HW, n_layers=3)
    kv = s * (cfg.kv_heads // 8) * cfg.head_dim * 2  # K (or V) of the whole sequence, bf16
    assert c.messages == 4 * 3 and c.wire_bytes == 4 * 3 * kv * 15 / 16
    assert cp_comm_per_micro(work, Layout(tp=8, cp=16, recompute="full"), HW, 1).messages == 6
    # cp folds into the ZeRO group: states of cp=4 x dp=2 equal dp=8's
    params = rank_params(cfg, Layout(tp=8, pp=9), 0)
    assert model_state_bytes(params, Layout(tp=8, pp=9, cp=4, dp=2, zero_stage=3), work.precision) == \
        model_state_bytes(params, Layout(tp=8, pp=9, dp=8, zero_stage=3), work.precision)


def test_cp_layout_problems() -> None:
    work = Workload(LLAMA31, 131072 + 8, 64)
    assert "divisible by 2 x cp (x tp) = 256" in str(layout_problem(work, Layout(tp=8, cp=16, dp=1), HW))
    assert "zero_stage=0" in str(layout_problem(Workload(LLAMA31, 131072, 64), Layout(tp=8, cp=2, zero_stage=0), HW))
    moe = Workload(model_config("mixtral-8x7b"), 32768, 64)
    assert "MoE" in str(layout_problem(moe, Layout(tp=8, cp=2), HW))
