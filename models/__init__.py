"""Tessera models: plain single-device PyTorch; parallelism is applied from outside by FQN."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from models.config import PRESETS, ModelConfig, MoEConfig, model_config
from models.flops import flops_per_token, num_params, param_counts

if TYPE_CHECKING:
    from models.decoder import Decoder, build_model


def __getattr__(name: str) -> Any:
    """`Decoder` and `build_model` load torch on first use, so `models.config` (every config load, every data
    stage process) does not: torch is ~230 MB and ~2 CPU-s a process."""
    if name in ("Decoder", "build_model"):
        from models import decoder

        return getattr(decoder, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = [
           "PRESETS",
           "Decoder",
           "MoEConfig",
           "ModelConfig",
           "build_model",
           "flops_per_token",
           "model_config",
           "num_params",
           "param_counts",
]
