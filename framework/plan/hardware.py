"""Accelerator and interconnect table the planner's time and memory estimates read.

Figures are vendor datasheet values for SXM parts in 8-GPU nodes (DGX/HGX): dense bf16 peak, HBM capacity and
bandwidth, NVLink bandwidth per direction, and one InfiniBand NIC per GPU (HDR 200 Gb/s on A100 systems, NDR
400 Gb/s on H100/H200). `bus_efficiency` is the fraction of link bandwidth a ring collective reaches (NCCL's
busbw on these systems is ~80% of the link); `mm_efficiency` is the fraction of peak a whole training step's
kernels sustain at large shapes, the one knob that turns FLOPs into seconds. Every field can be overridden
(`tessera plan --hw key=value`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from framework.base.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """One accelerator type in its node."""

    name: str
    memory_gib: float
    """Usable HBM per GPU as the driver reports it (GiB)."""
    peak_tflops: float
    """Dense bf16 tensor-core peak (TFLOP/s), the MFU denominator."""
    hbm_gbps: float
    """HBM bandwidth (GB/s): bounds the optimizer step."""
    nvlink_gbps: float
    """NVLink bandwidth per GPU per direction (GB/s)."""
    ib_gbps: float
    """Inter-node bandwidth per GPU per direction (GB/s): one NIC per GPU."""
    gpus_per_node: int = 8
    bus_efficiency: float = 0.8
    mm_efficiency: float = 0.6
    latency_us: float = 5.0
    """Latency of one ring step or point-to-point message (a ring collective over n ranks takes n-1 steps)."""
    nvme_gbps: float = 3.0
    """Local NVMe bandwidth per GPU (GB/s, read = write): a DGX/HGX node's 8 data drives (~25 GB/s) over 8 GPUs."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def link_bytes_per_s(self, intra_node: bool) -> float:
        """Achievable ring bandwidth per GPU for a group inside one node (NVLink) or spanning nodes (IB)."""
        return (self.nvlink_gbps if intra_node else self.ib_gbps) * 1e9 * self.bus_efficiency


HARDWARE: dict[str, Hardware] = {
    # A100 SXM: 312 TF bf16, NVLink3 600 GB/s bidirectional, HDR 200 Gb/s per GPU.
    "a100-40g": Hardware("a100-40g", 39.4, 312.0, 1555.0, 300.0, 25.0, mm_efficiency=0.65),
    "a100-80g": Hardware("a100-80g", 79.2, 312.0, 2039.0, 300.0, 25.0, mm_efficiency=0.65),
    # H100 SXM: 989 TF bf16 dense, NVLink4 900 GB/s bidirectional, NDR 400 Gb/s per GPU.
    "h100-80g": Hardware("h100-80g", 79.6, 989.0, 3350.0, 450.0, 50.0, mm_efficiency=0.6),
    # H200 SXM: the H100 compute with 141 GB of HBM3e at 4.8 TB/s.
    "h200": Hardware("h200", 139.8, 989.0, 4800.0, 450.0, 50.0, mm_efficiency=0.6),
}


def get_hardware(name: str, overrides: dict[str, str] | None = None) -> Hardware:
    """A table entry by name with `field=value` overrides applied (values parsed as numbers)."""
    if name not in HARDWARE:
        raise ConfigError(f"--gpu {name!r} is not in the hardware table; choose one of {', '.join(HARDWARE)} "
                          f"(and adjust it with --hw field=value)")
    hw = HARDWARE[name]
    fields = {f.name: f for f in dataclasses.fields(Hardware) if f.name != "name"}
    changes: dict[str, float | int] = {}
    for key, raw in (overrides or {}).items():
        if key not in fields:
            raise ConfigError(f"--hw {key}={raw}: unknown field; valid: {', '.join(fields)}")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"--hw {key}={raw!r} must be a number") from None
        if value <= 0:
            raise ConfigError(f"--hw {key}={raw} must be > 0")
        changes[key] = int(value) if key == "gpus_per_node" else value
    return dataclasses.replace(hw, **changes)  # type: ignore[arg-type]


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`["ib_gbps=25", ...]` -> dict, rejecting items without '='."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--hw {item!r} must look like field=value, e.g. ib_gbps=25")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def load_calibration(path: str, gpu: str) -> dict[str, str]:
    """`--hw` overrides from a GPU check's calibration JSON (bench/gpu_bench.py): its measured `mm_efficiency`.

    Raises ConfigError when the file is unreadable, measured another GPU than `gpu`, or holds no usable value.
    """
    import json

    try:
        data = json.loads(open(path).read())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--calibration {path}: cannot read it as JSON ({exc}); pass the gpu_calibration.json "
                          f"that bench/gpu_check.sh wrote") from None
    measured = str(data.get("gpu", ""))
    if measured != gpu:
        raise ConfigError(f"--calibration {path} measured gpu={measured!r}, but --gpu {gpu}; use the matching "
                          f"--gpu or the calibration of that GPU")
    eff = data.get("mm_efficiency")
    if not isinstance(eff, (int, float)) or not 0 < eff <= 1:
        raise ConfigError(f"--calibration {path}: mm_efficiency={eff!r} must be a number in (0, 1]")
    return {"mm_efficiency": str(eff)}


__all__ = ["GIB", "HARDWARE", "Hardware", "get_hardware", "load_calibration", "parse_overrides"]
