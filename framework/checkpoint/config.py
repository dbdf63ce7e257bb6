"""Checkpoint and fault-tolerance configuration (`checkpoint.*` in YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from framework.base.errors import ConfigError

REQUEUE_EXIT_CODE = 42
"""Exit code of every rank after a signal-triggered save or a watchdog timeout; launch/slurm requeues on it."""


@dataclass(kw_only=True, frozen=True)
class GuardConfig:
    """Loss-spike and NaN/inf guard: skip bad updates; after `max_consecutive` in a row, roll back."""

    enabled: bool = True
    zscore: float = 6.0
    """A loss more than this many standard deviations above the rolling mean is a spike; 0 disables spikes
    (non-finite losses and gradients are always caught)."""
    window: int = 50
    """Length of the rolling window of accepted losses the z-score is measured against."""
    min_history: int = 10
    """Spikes are only judged once the window holds this many losses (early training moves fast)."""
    max_consecutive: int = 3
    """After this many skipped steps in a row, roll back to the last checkpoint and skip that data window."""
    max_rollbacks: int = 3
    """Stop the run with an error (not the requeue code) after this many rollbacks, or at the second rollback to
    the same checkpoint: a divergence that survives skipping its data needs a person (lower the LR, fix data)."""
    triage: bool = True
    """Replay every skipped step (same ranks, then rows shifted one data rank on; two forward passes) to tell data
    from hardware; data goes to the loader's quarantine (framework/train/triage.py). A rollback after a data
    verdict resumes at the checkpoint's position, the quarantined samples skipped, instead of skipping the window."""

    def validate(self) -> None:
        if self.zscore < 0:
            raise ConfigError(f"checkpoint.guard.zscore={self.zscore} must be >= 0 (0 disables spike detection)")
        if self.window < 2 or not 2 <= self.min_history <= self.window:
            raise ConfigError(
                f"checkpoint.guard.window={self.window}, min_history={self.min_history}: need "
                f"2 <= min_history <= window; e.g. window=50, min_history=10")
        if self.max_consecutive < 1:
            raise ConfigError(f"checkpoint.guard.max_consecutive={self.max_consecutive} must be >= 1")
        if self.max_rollbacks < 0:
            raise ConfigError(f"checkpoint.guard.max_rollbacks={self.max_rollbacks} must be >= 0 (0: stop at the "
                              f"first rollback)")


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
    async_save: bool = False
    """Write checkpoints from a background thread (training continues; at most one save in flight)."""
    async_pin_budget_gb: float = 16.0
    """Pinned host memory per rank for async staging: a rank state that fits is staged into pinned buffers kept
    across saves; a larger one goes to pageable host memory through a pinned bucket of this size."""
    verify: Literal["checksum", "size", "none"] = "checksum"
    """What a load checks against the manifest: sizes and xxh3 checksums, sizes only, or nothing."""
    start_over: bool = False
    """When the run directory holds checkpoints and none verifies, move them aside (checkpoints/invalid-<time>/)
    and start at step 0 instead of refusing to start. A valid checkpoint is always resumed."""
    steps_change: Literal["refuse", "reshape"] = "refuse"
    """Resuming with a different train.steps: refuse (the LR schedule depends on the total), or reshape: recompute
    the schedule for the new total from the resumed step on (the LR jump is logged). A constant schedule needs
    neither."""
    allow_batch_size_change: bool = False
    """Resume even though train.global_batch_size differs (training continues from the same sample)."""
    allow_model_change: bool = False
    """Resume even though model.* differs from the checkpoint's (e.g. after a deliberate fine-tune change)."""
    allow_data_change: bool = False
    """Resume even though the data fingerprint differs from the checkpoint's."""
    requeue_exit_code: int = REQUEUE_EXIT_CODE
    """Exit code after a SIGTERM/SIGUSR1 save or a watchdog timeout (the SLURM script requeues on it)."""
    handle_signals: bool = True
    """Catch SIGTERM and SIGUSR1: save at the next step boundary and exit with `requeue_exit_code`."""
    watchdog_timeout_s: float = 0.0
    """Dump every rank's stacks and exit with `requeue_exit_code` when no step completes for this long; 0 off."""
    collective_timeout_s: float = 1800.0
    """Timeout of the training process group's collectives (must exceed watchdog_timeout_s so the watchdog,
    not a collective error, reports a hang)."""
    guard: GuardConfig = field(default_factory=GuardConfig)

    def validate(self) -> None:
        if self.async_pin_budget_gb <= 0:
            raise ConfigError(f"checkpoint.async_pin_budget_gb={self.async_pin_budget_gb} must be > 0 (pinned host "
                              f"memory per rank for asynchronous saves, e.g. 16)")
        if self.interval < 0:
            raise ConfigError(f"checkpoint.interval={self.interval} must be >= 0 (0 saves only at the end)")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 1 so a resume point always exists")
        if self.keep_every < 0:
            raise ConfigError(f"checkpoint.keep_every={self.keep_every} must be >= 0")
        if not 1 <= self.requeue_exit_code <= 255:
            raise ConfigError(
                f"checkpoint.requeue_exit_code={self.requeue_exit_code} must be in [1, 255]; the default is 42")
        if self.watchdog_timeout_s < 0 or self.collective_timeout_s <= 0:
            raise ConfigError(
                f"checkpoint.watchdog_timeout_s={self.watchdog_timeout_s} must be >= 0 and "
                f"checkpoint.collective_timeout_s={self.collective_timeout_s} > 0")
        if self.watchdog_timeout_s and self.collective_timeout_s <= self.watchdog_timeout_s:
            raise ConfigError(
                f"checkpoint.collective_timeout_s={self.collective_timeout_s} must exceed "
                f"checkpoint.watchdog_timeout_s={self.watchdog_timeout_s}, or a hang surfaces as a collective "
                f"error instead of stack dumps; raise collective_timeout_s to e.g. "
                f"{2 * self.watchdog_timeout_s:g}")
