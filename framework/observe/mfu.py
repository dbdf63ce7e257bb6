"""Throughput per device, model FLOPs utilization (MFU) and hardware FLOPs utilization (HFU).

All FLOPs come from the one definition in `models.flops.flops_per_token`. Three figures per step:

    mfu         common convention: 6N + 12·L·h·s per token (N without the input embedding, no causal halving) —
                what PaLM, Megatron and torchtitan publish, so numbers compare across papers;
    mfu_causal  the attention term halved, as a causal kernel skips the masked half — the honest figure;
    hfu         hardware FLOPs: the common count plus what activation recomputation repeats — one more forward
                of the recomputed layers for `parallel.recompute=full` (8N - 2·head + 16·L·h·s when every layer
                recomputes; Narayanan et al. 2021), the attention core's forward (4·L·h·s) for `selective`
                (Korthikanti et al. 2022); equal to `mfu` without recomputation.

MFU = (tokens/s per device) x (FLOPs per token) / (peak FLOP/s per device). The peak is the dense bf16 figure of
the table below for GPUs (sparsity excluded, as everyone reports), or the dense FP8 one (`PEAK_FP8_TFLOPS`) when
`observe.mfu_peak` says so (auto: with `train.fp8.enabled`), and a measured fp32 matmul rate on CPU (no FP8 peak
there). Every record names the peak it divided by (`mfu_peak`, `peak_tflops`): an FP8 run's MFU against the FP8
peak is about half its MFU against the bf16 one, and Megatron-Bridge's and torchtitan's published FP8 figures
are model TFLOP/s, not a fraction of either.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from models.config import ModelConfig
from models.flops import flops_per_token, mfu_flops_per_token

PEAK_TFLOPS: dict[str, float] = {
    "a100": 312.0,  # A100 SXM and PCIe alike, bf16 dense tensor core (NVIDIA A100 datasheet)
    "h100": 989.0,  # H100 SXM, bf16 dense (989.4; the datasheet's 1,979 assumes 2:4 sparsity)
    "h100-nvl": 835.0,  # H100 NVL (1,671 sparse)
    "h100-pcie": 756.0,  # H100 PCIe (1,513 sparse)
    "h200": 989.0,  # H200 SXM: the H100 SXM compute die with more and faster HBM
    "h200-nvl": 835.0,  # H200 NVL (PCIe card, 600 W)
}
"""Peak dense bf16 TFLOP/s per device, by accelerator name."""

PEAK_FP8_TFLOPS: dict[str, float] = {
    "h100": 1979.0,  # H100 SXM, FP8 dense (the datasheet's 3,958 assumes 2:4 sparsity)
    "h100-nvl": 1671.0,  # H100 NVL (3,341 sparse)
    "h100-pcie": 1513.0,  # H100 PCIe (3,026 sparse)
    "h200": 1979.0,  # H200 SXM: the H100 SXM compute die
    "h200-nvl": 1671.0,  # H200 NVL
}
"""Peak dense FP8 (e4m3/e5m2) TFLOP/s per device; the A100 has no FP8 tensor cores, so no row."""

# (substrings all in the lower-case CUDA device name, table row), most specific first. torch reports e.g.
# "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA A100-SXM4-80GB".
_NAME_ROWS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("gh200",), "h100"), (("h200", "nvl"), "h200-nvl"), (("h200",), "h200"),
    (("h100", "nvl"), "h100-nvl"), (("h100", "pcie"), "h100-pcie"), (("h100",), "h100"), (("a100",), "a100"),
)


def accelerator_row(name: str) -> str | None:
    """The peak-table row of a CUDA device name; None for a GPU the table does not know (H800, B200, L40S...)."""
    low = name.lower()
    return next((row for keys, row in _NAME_ROWS if all(k in low for k in keys)), None)


def detect_accelerator(device: torch.device) -> str | None:
    """The peak-table row of `device` ('cpu' on CPU, None for an unknown GPU)."""
    if device.type != "cuda":
        return "cpu"
    return accelerator_row(torch.cuda.get_device_name(device))


@functools.lru_cache(maxsize=4)
def measure_cpu_peak_tflops(size: int = 512, seconds: float = 0.3, threads: int | None = None) -> float:
    """Best observed fp32 matmul rate on this CPU, in TFLOP/s, with torch's current thread count.

    A square matmul of `size` is timed repeatedly for about `seconds`; the best run counts (others are noise from
    a shared machine). This is the achievable peak for our kernels, not a datasheet figure.
    """
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        out = torch.empty(size, size)
        torch.mm(a, b, out=out)  # warm-up
        best = float("inf")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
        return 2 * size**3 / best / 1e12
    finally:
        torch.set_num_threads(old)


def peak_tflops(device: torch.device, accelerator: str = "auto", override: float | None = None,
                dtype: str = "bf16") -> float | None:
    """Peak TFLOP/s per device: `override`, else the `dtype` (bf16 or fp8) table's row (detected when 'auto'),
    else measured on CPU (for either dtype: the CPU has no FP8 peak of its own).

    None (MFU off, with a warning naming the device and the fix) for a GPU the table does not know."""
    if override is not None:
        return override
    key = detect_accelerator(device) if accelerator == "auto" else accelerator
    if dtype == "fp8" and key not in (None, "cpu"):
        if key not in PEAK_FP8_TFLOPS:
            logging.getLogger(__name__).warning(
                "no FP8 peak for accelerator %r (no FP8 tensor cores): MFU/HFU are off; set observe.mfu_peak=bf16 "
                "or observe.peak_tflops", key)
        return PEAK_FP8_TFLOPS.get(key)
    if key is None:
        logging.getLogger(__name__).warning(
            "no peak-FLOPs figure for GPU %r: MFU/HFU are off; set observe.peak_tflops (dense bf16 TFLOP/s per "
            "device) or observe.accelerator (one of %s) to turn them on", torch.cuda.get_device_name(device),
            ", ".join(PEAK_TFLOPS))
        return None
    if key == "cpu":
        return measure_cpu_peak_tflops()
    return PEAK_TFLOPS[key]


def mfu(tokens_per_s_per_device: float, flops_per_tok: float, peak_tflops_per_device: float) -> float:
    """Achieved FLOP/s over peak FLOP/s (a fraction, not a percentage)."""
    return tokens_per_s_per_device * flops_per_tok / (peak_tflops_per_device * 1e12)


@dataclass(frozen=True)
class FlopsMeter:
    """Per-step MFU/HFU for one model shape, sequence length and number of devices.

    Args:
        flops_common: training FLOPs per token, common convention.
        flops_causal: the same with the attention term halved.
        flops_hardware: executed FLOPs per token (with recomputation when it is on).
        n_devices: devices sharing each step (the world size).
        peak_tflops: peak TFLOP/s of one device.
        peak: which peak that is (bf16 or fp8), stated in every record.
    """

    flops_common: float
    flops_causal: float
    flops_hardware: float
    n_devices: int
    peak_tflops: float
    peak: str = "bf16"

    @classmethod
    def for_model(cls, model: ModelConfig, seq_len: int, n_devices: int, peak: float,
                  recompute: str = "none", recompute_fraction: float = 1.0, peak_dtype: str = "bf16") -> FlopsMeter:
        """FLOPs of `model` at `seq_len`.

        Args:
            recompute: activation recomputation — none, full (one extra forward of the recomputed layers) or
                selective (recomputes the attention core: the forward third of the attention term).
            recompute_fraction: share of the layers that recompute (parallel.recompute_every).
        """
        common = mfu_flops_per_token(model, seq_len)
        causal = flops_per_token(model, seq_len, causal=True)
        if recompute == "full":
            extra = flops_per_token(model, seq_len, recompute=True) - common
        elif recompute == "selective":
            attention = 2 * (common - causal)  # 12·L·h·s, from the one FLOPs function
            extra = attention / 3
        else:
            extra = 0.0
        return cls(flops_common=common, flops_causal=causal, flops_hardware=common + recompute_fraction * extra,
                   n_devices=n_devices, peak_tflops=peak, peak=peak_dtype)

    def metrics(self, tokens_per_s: float) -> dict[str, float | str]:
        """Record fields for a step that processed `tokens_per_s` tokens/s over all devices."""
        per_device = tokens_per_s / self.n_devices
        return {
            "tokens_per_s_per_device": per_device,
            "tflops_per_device": per_device * self.flops_common / 1e12,
            "mfu": mfu(per_device, self.flops_common, self.peak_tflops),
            "mfu_causal": mfu(per_device, self.flops_causal, self.peak_tflops),
            "hfu": mfu(per_device, self.flops_hardware, self.peak_tflops),
            "mfu_peak": self.peak,
            "peak_tflops": self.peak_tflops,
        }
