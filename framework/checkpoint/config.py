"""Checkpoint configuration."""

from __future__ import annotations

from dataclasses import dataclass

from framework.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    interval: int = 0
    """Save every N steps (and at the end of training); 0 saves only at the end."""
    keep_last: int = 2
    """Keep the newest k checkpoints..."""
    keep_every: int = 0
    """...plus every M-th step forever; 0 keeps none beyond the newest k."""
    resume: bool = True
    """Resume from `latest` in the run directory when it exists."""
    save_final: bool = True

    def validate(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"checkpoint.interval={self.interval} must be >= 0 (0 saves only at the end)")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 1 so a resume point always exists")
        if self.keep_every < 0:
            raise ConfigError(f"checkpoint.keep_every={self.keep_every} must be >= 0")
