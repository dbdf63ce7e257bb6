"""Write a planned layout as a ready Tessera YAML config (`tessera plan --write-config PATH`).

Only keys that exist in the config dataclasses are written (so the file loads with
`framework.config.load_config`); the planner's estimates go into a comment header. The layout is written whole
(cp included: the world size the launcher checks is the planned one), and the data section names a placeholder
build directory that the launchers refuse until it is set.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from framework.plan.hardware import Hardware
from framework.plan.layout import Layout, Workload
from models.config import PRESETS, ModelConfig

DATA_PLACEHOLDER = "/shared/SET_ME/data_build"
"""data.build_dir of a written config: the output of `tessera data build` on the cluster's shared filesystem."""


def _diff(full: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The entries of `full` that differ from `base`, recursing into nested sections."""
    out: dict[str, Any] = {}
    for key, value in full.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            nested = _diff(value, base[key])
            if nested:
                out[key] = nested
        elif base.get(key) != value:
            out[key] = value
    return out


def _model_section(cfg: ModelConfig) -> dict[str, Any]:
    """The preset name plus the fields that differ from it, or the fields of a custom model that differ from
    the defaults."""
    from framework.config import to_dict

    full = {k: v for k, v in to_dict(cfg).items() if k != "preset"}
    if cfg.preset and cfg.preset in PRESETS:
        from models.config import model_config

        return {"preset": cfg.preset, **_diff(full, to_dict(model_config(cfg.preset)))}
    return _diff(full, to_dict(ModelConfig()))


def config_dict(work: Workload, lay: Layout) -> dict[str, Any]:
    """The config mapping for `lay` (keys checked against ParallelConfig/TrainConfig fields)."""
    from framework.parallel.config import ParallelConfig
    from framework.train.config import TrainConfig

    parallel: dict[str, Any] = {
        "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero_stage": lay.zero_stage,
        "dp_shard": 1 if lay.zero_stage == 0 else lay.dp, "dp_replicate": lay.dp if lay.zero_stage == 0 else 1,
        "sequence_parallel": lay.sp, "pp_schedule": lay.schedule, "pp_virtual_stages": lay.virtual,
        "recompute": lay.recompute, "fsdp_prefetch": lay.prefetch,
    }
    if lay.nvme_offload:  # the directory is the site's: the run refuses to start until it names a local one
        parallel["nvme_offload"] = {"path": "/local_nvme/SET_ME", "buffer_count": 4}
    train: dict[str, Any] = {"global_batch_size": work.global_batch, "micro_batch_size": lay.micro_batch,
                             "precision": "bf16" if work.precision.param == 2 else "fp32"}
    if work.optimizer == "muon":
        train["optimizer"] = "muon"
    known_parallel = {f.name for f in dataclasses.fields(ParallelConfig)}
    known_train = {f.name for f in dataclasses.fields(TrainConfig)}
    return {
        "model": _model_section(work.model),
        # The corpus is the site's: a placeholder that launch refuses (no manifest there) until it names a real
        # build, rather than the embedded stdlib corpus a missing data section would mean.
        "data": {"kind": "build", "build_dir": DATA_PLACEHOLDER, "seq_len": work.seq_len},
        "train": {k: v for k, v in train.items() if k in known_train},
        "parallel": {k: v for k, v in parallel.items() if k in known_parallel},
    }


def write_config(path: str | Path, work: Workload, lay: Layout, hw: Hardware) -> Path:
    """Write the YAML config for `lay` and check that it loads; returns the path."""
    from framework.config import load_config
    from framework.plan.estimate import estimate

    est = estimate(work, lay, hw)
    header = (f"# Written by `tessera plan` for {lay.world} x {hw.name}: {lay.describe()}\n"
              f"# estimated: {est.memory_bytes / 2**30:.1f} GiB peak per GPU, step {est.step_s:.2f} s, "
              f"MFU {est.mfu * 100:.1f}%, HFU {est.hfu * 100:.1f}%\n")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + yaml.safe_dump(config_dict(work, lay), sort_keys=False))
    load_config(out)  # a config the planner writes must load; raises ConfigError naming the key otherwise
    return out


__all__ = ["config_dict", "write_config"]
