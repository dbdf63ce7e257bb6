"""Parallel layout configuration (world = pp x dp_replicate x dp_shard x cp x tp; ep carved from data ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from framework.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree; must divide model.n_heads and model.n_kv_heads."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    dp_shard: int = -1
    """ZeRO/FSDP sharding degree; -1 infers it from the world size."""
    dp_replicate: int = 1
    """Replicated data-parallel degree (DDP, or HSDP with dp_shard > 1)."""
    cp: int = 1
    """Context parallelism, reserved: must be 1."""
    ep: int = 1
    """Expert parallelism, carved out of dp_shard x tp."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """0: replicate; 1: shard optimizer state; 2: + gradients; 3: + parameters."""

    def validate(self) -> None:
        for name in ("tp", "pp", "dp_replicate", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard} must be >= 1, or -1 to infer from the world size")
        if self.cp != 1:
            raise ConfigError(f"parallel.cp={self.cp}: context parallelism is reserved; set parallel.cp=1")
