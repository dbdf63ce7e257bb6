"""ZeRO-3's exposed communication and NVMe offload in the planner.

The former model hid every all-gather and reduce-scatter behind compute as long as a pass's totals fit, so
Llama-3 405B on 2,048 H100s ranked TP2 x DP1024 ZeRO-3 first at 44.0% MFU with no data-parallel time at all.
Per FSDP unit, a pass's first gather and backward's last reduce-scatter cannot hide, and a unit whose
gather outlasts its neighbour's compute shows the excess.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from framework.base.errors import ConfigError
from framework.parallel.offload import check_offload_path
from framework.plan.estimate import _zero3_exposed, estimate, zero3_pass_exposed
from framework.plan.hardware import get_hardware
from framework.plan.layout import Layout, Workload
from framework.plan.memory import peak_memory
from framework.plan.search import plan
from models.config import model_config

WORK = Workload(model_config("llama3-405b", max_seq_len=8192), 8192, 2048)
DP1024 = Layout(tp=2, pp=1, dp=1024, zero_stage=3, recompute="full", micro_batch=2)


def test_unit_pipeline_exposes_the_first_gather_and_the_last_reduce_and_any_excess() -> None:
    # 10 units, 1 micro-batch: gathers of 1 s per unit per pass, reduce-scatters 1 s, forward 2 s, backward 4 s.
    assert _zero3_exposed(20.0, 10.0, 1, 10, 20.0, 40.0, prefetch=1) == pytest.approx(1.0 + 1.0 + 1.0)
    # forward units of 0.5 s: each later gather shows 0.5 s; backward units of 1.5 s under 2 s of traffic
    assert _zero3_exposed(20.0, 10.0, 1, 10, 5.0, 15.0, prefetch=1) == pytest.approx(
        (1.0 + 9 * 0.5) + (2.0 + 9 * 0.5))
    # prefetch 0 (FSDP2's default): every forward gather waits; backward still prefetches one unit implicitly
    assert _zero3_exposed(20.0, 10.0, 1, 10, 20.0, 40.0, prefetch=0) == pytest.approx(10.0 + 1.0 + 1.0)
    # per micro-batch: m passes of each
    assert _zero3_exposed(40.0, 20.0, 2, 10, 20.0, 40.0, prefetch=1) == pytest.approx(2 * 3.0)


def test_unequal_units_and_a_blocking_reduce_scatter() -> None:
    # Units as the engine runs them (bench/zero_overlap.py builds these from measured timelines): a gather-less
    # unit (not resharded) first, then gathers of 1 s behind 0.5 s / 3 s of compute.
    gathers, reduces, computes = [0.0, 1.0, 1.0], [0.5, 0.5, 0.5], [0.5, 3.0, 1.0]
    # async reduce-scatter (GPU streams): unit 1's gather + unit 0's reduce under unit 0's 0.5 s shows 1 s,
    # unit 2's under unit 1's 3 s hides, and the last reduce-scatter shows
    assert zero3_pass_exposed(gathers, reduces, computes, prefetch=1) == pytest.approx(1.0 + 0.5)
    assert zero3_pass_exposed(gathers, reduces, computes, prefetch=0) == pytest.approx(2.0 + 0.0 + 0.0 + 0.5)
    # FSDP2 on gloo reduce-scatters synchronously: all 1.5 s of reduce-scatter shows; gathers hide behind the
    # previous unit's compute and reduce-scatter (1 s behind 1 s: nothing left; 1 s behind 3.5 s)
    assert zero3_pass_exposed(gathers, reduces, computes, prefetch=1, blocking_reduce=True) == pytest.approx(1.5)
    assert zero3_pass_exposed(gathers, reduces, computes, prefetch=0, blocking_reduce=True) == pytest.approx(3.5)


def test_405b_dp1024_zero3_pays_for_its_gathers_and_loses_first_place_when_they_stop_hiding() -> None:
    hw = get_hardware("h100-80g")
    est = estimate(WORK, DP1024, hw)
    units = WORK.model.n_layers
    first_gather = est.comm["dp_gather"].seconds / (2 * units)
    last_reduce = est.comm["dp_reduce"].seconds / units
    # exposed: at least each pass's first gather and the last reduce-scatter, no longer zero
    assert est.time["dp_exposed"] >= 2 * first_gather + last_reduce - 1e-9
    assert est.mfu < 0.440  # the all-hidden model's 44.0%
    top = plan(WORK, 2048, hw).top(3)
    assert top[0].layout.describe() == DP1024.describe()  # with prefetch and 50 GB/s NDR it still ranks first
    # prefetch 0 (FSDP2's default): every forward gather is exposed, backward still prefetches one unit:
    # ~11.0 s a step, MFU 36.0%.
    no_prefetch = estimate(WORK, dataclasses.replace(DP1024, prefetch=0), hw)
    assert no_prefetch.time["dp_exposed"] >= est.comm["dp_gather"].seconds / 2
    assert no_prefetch.mfu < 0.37
    # Half the inter-node bandwidth: a unit's gather (172 ms) outlasts its forward (95 ms); a wider TP (half
    # the dp traffic per rank) takes first place.
    slow = get_hardware("h100-80g", {"ib_gbps": "25"})
    ranked = plan(WORK, 2048, slow).top(5)
    assert ranked[0].layout.tp >= 4 and ranked[0].layout.dp <= 512
    slow_dp1024 = estimate(WORK, DP1024, slow)
    assert slow_dp1024.mfu < ranked[0].mfu - 0.05


def test_nvme_offload_frees_the_optimizer_states_and_costs_their_io() -> None:
    hw = get_hardware("h100-80g")
    lay = Layout(tp=8, pp=1, dp=16, zero_stage=3, recompute="full", micro_batch=1)
    work = dataclasses.replace(WORK, global_batch=16)
    plain, offloaded = estimate(work, lay, hw), estimate(work, dataclasses.replace(lay, nvme_offload=True), hw)
    states = plain.memory["optimizer"]
    assert states > 0 and offloaded.memory["optimizer"] == 0.0
    assert peak_memory(work, dataclasses.replace(lay, nvme_offload=True))[0] == pytest.approx(
        plain.memory_bytes - states)
    # read + write 8 bytes per parameter of the rank's shard at nvme_gbps
    assert offloaded.time["nvme_io"] == pytest.approx(2 * states / (hw.nvme_gbps * 1e9))
    assert offloaded.step_s > plain.step_s + offloaded.time["nvme_io"] * 0.99
    assert "nvme" in dataclasses.replace(lay, nvme_offload=True).describe()


def test_an_offloaded_layout_exports_a_config_that_names_the_directory_to_set(tmp_path: Path) -> None:
    from framework.config import load_config
    from framework.plan.export import write_config

    hw = get_hardware("h100-80g")
    lay = Layout(tp=8, pp=1, dp=16, zero_stage=3, recompute="full", micro_batch=1, nvme_offload=True, prefetch=2)
    cfg = load_config(write_config(tmp_path / "p.yaml", dataclasses.replace(WORK, global_batch=16), lay, hw))
    assert cfg.parallel.fsdp_prefetch == 2 and cfg.parallel.nvme_offload.enabled
    with pytest.raises(ConfigError, match="SET_ME' does not exist"):  # refused before step 1 until it is set
        check_offload_path(cfg.parallel.nvme_offload.path, 1)


def test_zeropp_in_the_comm_memory_and_time_models() -> None:
    """ZeRO++: qwZ halves the bf16 gather bytes, qgZ quarters the fp32 reduce bytes (+4/B of scales),
    hpZ moves backward's gathers onto the node (less time, same order of bytes) for 2 bytes/s x Ψ of memory, and on
    a slow inter-node network each shortens the step (Llama-3 8B, DP256 ZeRO-3, ib_gbps=25)."""
    from framework.plan.comm import QUANT_BLOCK, dp_comm_per_step
    from framework.plan.memory import rank_params

    work = Workload(model_config("llama3-8b", max_seq_len=8192), 8192, 1024)
    hw = dataclasses.replace(get_hardware("h100-80g"), ib_gbps=25)
    base = Layout(tp=1, pp=1, dp=256, zero_stage=3, recompute="full", micro_batch=1)
    q = 1 + 4 / QUANT_BLOCK

    def run(**kw: object) -> tuple[dict, float, float]:
        lay = dataclasses.replace(base, **kw)  # type: ignore[arg-type]
        return (dp_comm_per_step(work, lay, hw, rank_params(work.model, lay, 0)), estimate(work, lay, hw).step_s,
                peak_memory(work, lay)[2].get("hpz_secondary", 0.0))

    plain, t_plain, _ = run()
    qwz, t_qwz, _ = run(qwz=True)
    qgz, t_qgz, _ = run(qgz=True)
    hpz, t_hpz, secondary = run(hpz=8)
    both, t_both, _ = run(qgz=True, hpz=8)
    assert qwz["gather"].wire_bytes / plain["gather"].wire_bytes == pytest.approx(q / 2)
    assert qgz["reduce"].wire_bytes / plain["reduce"].wire_bytes == pytest.approx(q / 4)
    assert hpz["gather"].seconds < 0.6 * plain["gather"].seconds  # half the gathers now on NVLink
    assert secondary == pytest.approx(rank_params(work.model, base, 0).dense * 2 / 8)
    # two hops: the cross-node part is 1/8 of the one-hop volume
    assert both["reduce"].seconds < 0.3 * qgz["reduce"].seconds
    assert t_both < t_qgz < t_plain and t_qwz < t_plain and t_hpz < t_plain


def test_zeropp_plan_flag_refuses_qwz_with_hpz() -> None:
    import argparse

    from framework.plan.cli import add_arguments, space_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = ["--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch", "64", "--zeropp"]
    with pytest.raises(ConfigError, match="qwz with hpz is refused"):
        space_from_args(p.parse_args([*args, "qwz,hpz"]))
    assert space_from_args(p.parse_args([*args, "qwz,qgz"])).zeropp == {"qwz", "qgz"}
