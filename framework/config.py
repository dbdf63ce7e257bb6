"""Tessera's configuration: one typed tree of small frozen dataclasses, loaded strictly from YAML.

`load_config("configs/smoke/tiny.yaml", ["train.lr=1e-3"])` reads the file (and its `base:` chain), applies the
dotted overrides (values parsed with `yaml.safe_load`), resolves the model preset, converts strictly and runs
every section's `validate()` plus the cross-section checks here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from data_pipeline.config import DataConfig
from framework.base.errors import ConfigError, ParallelismError
from framework.base.yaml_config import (
    apply_overrides,
    deep_merge,
    from_dict,
    load_yaml,
    replace,
    to_dict,
    validate_tree,
)
from framework.checkpoint.config import CheckpointConfig
from framework.infer.config import EvalConfig
from framework.observe.config import ObserveConfig
from framework.parallel.config import ParallelConfig, context_problem, mtp_problem
from framework.train.config import TrainConfig
from models.config import PRESETS, ModelConfig


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    name: str = "default"
    dir: str | None = None
    """Run directory; None means runs/<run.name>."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ConfigError(f"run.name={self.name!r} must be a non-empty name without '/'; e.g. smoke")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"run.device={self.device!r} must be auto, cpu or cuda")


@dataclass(kw_only=True, frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Downstream tasks scored in the loop (framework/infer)."""

    def validate(self) -> None:
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                f"raise model.max_seq_len or lower data.seq_len")
        if self.data.eod_id is not None and self.data.eod_id >= self.model.vocab_size:
            raise ConfigError(
                f"data.eod_id={self.data.eod_id} is outside model.vocab_size={self.model.vocab_size}; set data.eod_id "
                f"to the id that ends each document (null: the tokenizer's EOS)")
        tp = self.parallel.tp
        problem = context_problem(self.data.seq_len, self.parallel.cp, tp, self.parallel.sequence_parallel)
        if problem:
            raise ParallelismError(problem)
        if mtp_why := mtp_problem(self.model.mtp_depth, self.parallel.pp, self.parallel.pp_schedule,
                                  self.model.tied_embeddings):
            raise ParallelismError(mtp_why)
        if tp > 1 and self.parallel.sequence_parallel and self.data.seq_len % tp:
            fits = [n for n in range(self.data.seq_len - tp, self.data.seq_len + tp + 1) if n > 0 and n % tp == 0]
            raise ParallelismError(
                f"data.seq_len={self.data.seq_len} must be divisible by parallel.tp={tp}: sequence parallelism cuts "
                f"every sequence into tp equal pieces; use data.seq_len={' or '.join(map(str, fits))}, or set "
                f"parallel.sequence_parallel=false")
        if self.train.muon.per_head and self.model.attention == "mla":
            raise ConfigError("train.muon.per_head=true splits wq/wk/wv/wo into head blocks; MLA's projections "
                              "(models/mla.py) have other shapes: set model.attention=gqa or train.muon.per_head=false")
        if self.train.muon.qk_clip and (why := _qk_clip_problem(self)):
            raise ConfigError(f"train.muon.qk_clip=true {why}")
        if self.train.optimizer == "muon" and self.parallel.nvme_offload.enabled:
            raise ConfigError(
                f"train.optimizer=muon cannot keep its states on NVMe (parallel.nvme_offload.path="
                f"{self.parallel.nvme_offload.path!r} streams AdamW's exp_avg/exp_avg_sq only); set "
                f"parallel.nvme_offload.path='' or train.optimizer=adamw")
        from framework.parallel.mesh import zeropp_compile_problem

        if problem := zeropp_compile_problem(self.parallel, self.train.compile):
            raise ParallelismError(problem)
        from framework.numerics.config import fp8_problem

        fp8_why = fp8_problem(self.train.precision, self.train.compile, self.train.fp8, self.parallel, self.model)
        if fp8_why is not None:
            raise ConfigError(fp8_why)
        if self.train.compile:  # only layouts whose compiled run matched eager (tests/parallel/test_compile.py)
            from framework.parallel.compile import refusal

            why = refusal(self.train.compile_backend, self.parallel, self.model)
            if why is not None:
                raise ParallelismError(why)


def _resolve_model_preset(data: dict[str, Any]) -> dict[str, Any]:
    model = data.get("model")
    if not isinstance(model, Mapping) or model.get("preset") is None:
        return data
    name = model["preset"]
    if not isinstance(name, str) or name not in PRESETS:
        import difflib

        close = difflib.get_close_matches(str(name), list(PRESETS), n=3)
        raise ConfigError(
            f"model.preset={name!r} is not a known preset; "
            + (f"did you mean {', '.join(close)}? " if close else "")
            + f"known: {', '.join(sorted(PRESETS))}")
    return {**data, "model": deep_merge(PRESETS[name], model)}


def _derive_data_vocab(data: dict[str, Any]) -> dict[str, Any]:
    """data.vocab_size follows model.vocab_size (the one canonical key) unless given; a different value still
    works (a tokenizer smaller than the embedding) but says it is deprecated."""
    model: Mapping[str, Any] = data["model"] if isinstance(data.get("model"), Mapping) else {}
    section: Mapping[str, Any] = data["data"] if isinstance(data.get("data"), Mapping) else {}
    model_vocab = model.get("vocab_size", ModelConfig.vocab_size)
    if "vocab_size" not in section:
        return {**data, "data": {**section, "vocab_size": model_vocab}}
    if section["vocab_size"] != model_vocab:
        from framework.base.logs import get_logger

        get_logger("config").warning(
            "data.vocab_size=%s differs from model.vocab_size=%s: data.vocab_size is deprecated (the tokenizer "
            "vocabulary follows model.vocab_size); remove it, or keep it only for a tokenizer smaller than the "
            "embedding", section["vocab_size"], model_vocab)
    return data


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Strictly convert and validate a plain mapping."""
    cfg = from_dict(Config, _derive_data_vocab(_resolve_model_preset(dict(data))))
    validate_tree(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply `a.b.c=value` overrides."""
    data = load_yaml(path) if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides))


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (written into every run directory and checkpoint)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


__all__ = ["Config", "ConfigError", "RunConfig", "config_from_dict", "dump_config", "load_config", "replace",
           "to_dict"]


def _qk_clip_problem(cfg: Config) -> str | None:
    """Why QK-clip cannot run with this config (framework/train/qk_clip.py), or None."""
    m = cfg.model
    if cfg.train.optimizer != "muon":
        return f"is MuonClip's half and needs train.optimizer=muon (not {cfg.train.optimizer})"
    if m.attention == "mla":
        return ("is built for MHA/GQA; MLA clips its per-head and shared RoPE parts by their own rule (Kimi K2), "
                "not implemented: set model.attention=gqa or train.muon.qk_clip=false")
    if m.qk_norm:
        return "with model.qk_norm=true: a normalized query or key does not scale with its projection; drop one"
    if cfg.parallel.cp > 1:
        return (f"with parallel.cp={cfg.parallel.cp}: a cp rank sees its chunk's queries against all keys only "
                f"inside the context kernel, where the largest logit is not read out; set parallel.cp=1")
    if cfg.train.compile:
        return "with train.compile=true: the logit maximum is recorded eagerly; set train.compile=false"
    if cfg.parallel.tp > m.kv_heads:
        return (f"with parallel.tp={cfg.parallel.tp} > model.n_kv_heads={m.kv_heads}: key heads replicated over "
                f"tp ranks are not clipped yet; use tp <= {m.kv_heads}")
    return None
