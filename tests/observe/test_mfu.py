"""MFU/HFU: a hand calculation for a fixed tiny config and torchtitan's published Llama-3 8B figure."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from framework.observe.mfu import PEAK_TFLOPS, FlopsMeter, measure_cpu_peak_tflops, mfu, peak_tflops
from models.config import model_config
from models.flops import flops_per_token


def test_mfu_matches_hand_calculation() -> None:
    # test-tiny: vocab 512, hidden 64, 4 layers, 4 heads (head_dim 16), 2 kv heads, SwiGLU ffn 128, untied head.
    # Per layer: q 64*64 + k,v 2*64*32 + o 64*64 = 12288; MLP 3*64*128 = 24576; two RMSNorms 128 -> 36992.
    # N = 4*36992 + final norm 64 + head 512*64 = 180800 (the input embedding is excluded).
    # seq 32: attention 12*4*64*32 = 98304; common 6N + attn = 1_183_104; causal 6N + attn/2 = 1_133_952;
    # full recompute 8N - 2*head (the head is not recomputed: 2*512*64) + 16*4*64*32 = 1_511_936.
    cfg = model_config("test-tiny")
    assert flops_per_token(cfg, 32) == 1_183_104
    meter = FlopsMeter.for_model(cfg, 32, n_devices=2, peak=1.0, recompute="full")
    m = meter.metrics(tokens_per_s=1000.0)  # 500 tokens/s per device against 1 TFLOP/s
    assert m["tokens_per_s_per_device"] == 500.0
    assert m["mfu"] == pytest.approx(500 * 1_183_104 / 1e12, rel=1e-12)
    assert m["mfu_causal"] == pytest.approx(500 * 1_133_952 / 1e12, rel=1e-12)
    assert m["hfu"] == pytest.approx(500 * 1_511_936 / 1e12, rel=1e-12)
    assert m["tflops_per_device"] == pytest.approx(500 * 1_183_104 / 1e12, rel=1e-12)
    no_recompute = FlopsMeter.for_model(cfg, 32, n_devices=2, peak=1.0).metrics(1000.0)
    assert no_recompute["hfu"] == no_recompute["mfu"]
    # Selective recomputation repeats the attention core's forward: 4*4*64*32 = 32768 FLOPs per token.
    selective = FlopsMeter.for_model(cfg, 32, n_devices=2, peak=1.0, recompute="selective").metrics(1000.0)
    assert selective["hfu"] == pytest.approx(500 * (1_183_104 + 32_768) / 1e12, rel=1e-12)
    # Full recomputation on every other layer (recompute_every=2 on 4 layers): half of the extra forward.
    half = FlopsMeter.for_model(cfg, 32, n_devices=2, peak=1.0, recompute="full", recompute_fraction=0.5)
    assert half.flops_hardware == pytest.approx((1_183_104 + 1_511_936) / 2)


def test_torchtitan_llama3_8b_h100() -> None:
    # torchtitan (docs/performance.md): Llama 3 8B, seq 8192, 5,762 tokens/s per H100 -> MFU 33.7% of 989 TFLOP/s.
    cfg = model_config("llama3-8b")
    ours = mfu(5762, flops_per_token(cfg, 8192), PEAK_TFLOPS["h100"])
    assert abs(ours - 0.337) / 0.337 < 0.01, ours
    causal = mfu(5762, flops_per_token(cfg, 8192, causal=True), PEAK_TFLOPS["h100"])
    assert causal < ours  # the causal-aware figure is lower: half the attention FLOPs are not counted


def test_peak_table_and_cpu_measurement() -> None:
    assert PEAK_TFLOPS["h100"] == 989.0 and PEAK_TFLOPS["a100"] == 312.0 and PEAK_TFLOPS["h200"] == 989.0
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, "h100") == 989.0
    assert peak_tflops(cpu, "auto", override=2.5) == 2.5
    measured = measure_cpu_peak_tflops()
    assert peak_tflops(cpu) == measured
    # A plain matmul timed here cannot beat the measured peak by much (the peak is the best of many runs).
    a = torch.randn(256, 256)
    best = math.inf
    for _ in range(5):
        import time

        t0 = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - t0)
    assert 0 < 2 * 256**3 / best / 1e12 < 3 * measured


@pytest.mark.parametrize(("name", "row"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA GH200 480GB", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100 80GB PCIe", "a100"),
    ("NVIDIA H800", None), ("NVIDIA B200", None), ("NVIDIA L40S", None),
])
def test_peak_table_tells_gpus_apart_by_name(name: str, row: str | None) -> None:
    from framework.observe.mfu import accelerator_row

    assert accelerator_row(name) == row
    assert row is None or PEAK_TFLOPS[row] in (312.0, 989.0, 835.0, 756.0)


def test_unknown_gpu_turns_mfu_off_with_a_named_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Fake CUDA (torch.cuda.get_device_name monkeypatched): no CPU path names a GPU. An H800 starts the observer
    (no KeyError) with MFU off and a warning naming the device and the fix."""
    from framework.config import load_config
    from framework.observe.observer import Observer
    from framework.testing.tiny import TINY

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H800")
    cfg = load_config(TINY)
    with caplog.at_level("WARNING"):
        observer = Observer.for_config(cfg, tmp_path, 1, 8, torch.device("cuda", 0))
    assert observer.meter is None
    assert "'NVIDIA H800'" in caplog.text and "observe.peak_tflops" in caplog.text
    pinned = Observer.for_config(load_config(TINY, ["observe.peak_tflops=900"]), tmp_path, 1, 8,
                                 torch.device("cuda", 0))
    assert pinned.meter is not None and pinned.meter.peak_tflops == 900


def test_one_mfu_convention_for_observer_and_planner() -> None:
    """The observer's `mfu` and the planner's MFU count FLOPs through models.flops.mfu_flops_per_token."""
    from framework.plan.estimate import estimate
    from framework.plan.hardware import get_hardware
    from framework.plan.layout import Layout, Workload
    from models.flops import mfu_flops_per_token

    cfg = model_config("llama3-8b")
    meter = FlopsMeter.for_model(cfg, 4096, n_devices=8, peak=989.0)
    assert meter.flops_common == mfu_flops_per_token(cfg, 4096) == flops_per_token(cfg, 4096)  # non-causal
    est = estimate(Workload(cfg, 4096, 64), Layout(dp=8), get_hardware("h100-80g"))
    assert est.flops[0] == pytest.approx(mfu_flops_per_token(cfg, 4096) * 4096 * 64)
    assert meter.metrics(est.tokens_per_s)["mfu"] == pytest.approx(est.mfu)


def test_fp8_run_divides_by_the_fp8_peak_and_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """observe.mfu_peak: an FP8 run on an H100 reports MFU against the dense FP8 peak (1,979 TFLOP/s, twice the
    bf16 one), a bf16 run against the bf16 peak, each record naming which; an A100 (no FP8 tensor cores) has no FP8
    peak, and a CPU's measured fp32 rate is labelled as such."""
    from framework.config import load_config
    from framework.observe.observer import Observer
    from framework.testing.tiny import TINY

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    fp8 = ["train.precision=bf16", "train.fp8.enabled=true"]
    cases = [(fp8, "fp8", 1979.0), ([], "bf16", 989.0), ([*fp8, "observe.mfu_peak=bf16"], "bf16", 989.0),
             (["observe.mfu_peak=fp8"], "fp8", 1979.0)]
    for overrides, label, peak in cases:
        meter = Observer.for_config(load_config(TINY, overrides), tmp_path, 1, 8, gpu).meter
        assert meter is not None
        record = meter.metrics(1e5)
        assert (record["mfu_peak"], record["peak_tflops"]) == (label, peak), overrides
        assert record["mfu"] == pytest.approx(1e5 / 8 * meter.flops_common / (peak * 1e12))
    a100 = Observer.for_config(load_config(TINY, [*fp8, "observe.accelerator=a100"]), tmp_path, 1, 8, gpu)
    assert a100.meter is None
    cpu = Observer.for_config(load_config(TINY, fp8), tmp_path, 1, 8, torch.device("cpu")).meter
    assert cpu is not None and cpu.metrics(1.0)["mfu_peak"] == "cpu-fp32"
