"""What the training loop calls for fault tolerance, in one object.

    ft = FaultTolerance(cfg.checkpoint, run_dir.path, device)
    with ft.running():                  # signal handlers + hang watchdog for the loop's lifetime
        ...
        verdict = ft.guard.check(loss, grad_norm)   # in the step: skip the update when verdict.skip
        ft.step_done(step)              # after every step: feeds the watchdog
        if ft.stop_requested(): ...     # every rank, every step boundary: agreed SIGTERM/SIGUSR1/SIGINT stop

Checkpoint saving and loading go through `ft.manager` (framework/checkpoint/manager.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from framework.checkpoint import signals as stop_signals
from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.dcp import rank_world
from framework.checkpoint.guard import LossGuard
from framework.checkpoint.manager import CheckpointManager
from framework.checkpoint.resume_rules import LrAt
from framework.checkpoint.signals import StopSignals
from framework.checkpoint.watchdog import Watchdog


class FaultTolerance:
    """Checkpoint manager, loss guard, stop signals and hang watchdog of one run, on every rank."""

    def __init__(self, cfg: CheckpointConfig, run_path: Path, device: torch.device, lr_at: LrAt | None = None
                 ) -> None:
        self.cfg = cfg
        self.device = device
        self.rank, self.world = rank_world()
        self.manager = CheckpointManager(cfg, run_path / "checkpoints", lr_at)
        self.guard = LossGuard(cfg.guard)
        self.stacks_dir = run_path / "stacks"
        self.signals: StopSignals | None = None
        self.watchdog: Watchdog | None = None

    @property
    def exit_code(self) -> int:
        """After an agreed stop: the requeue code (SIGTERM/SIGUSR1) or 130 (SIGINT)."""
        return self.cfg.requeue_exit_code if self.signals is None else self.signals.exit_code

    @contextlib.contextmanager
    def running(self) -> Iterator[FaultTolerance]:
        """Signal handlers and the watchdog for the loop; on the way out, wait for the save in flight."""
        owned = None
        if self.cfg.handle_signals:
            # `tessera train` installs the handlers before setup (a signal there raises StopSignal); the loop arms
            # them so that a signal only sets the flag.
            self.signals = stop_signals.active()
            if self.signals is None:
                self.signals = owned = StopSignals().install()
            self.signals.armed = True
            self.signals.requeue_exit_code = self.cfg.requeue_exit_code
        if self.cfg.watchdog_timeout_s > 0:
            self.watchdog = Watchdog(self.cfg.watchdog_timeout_s, self.stacks_dir, self.rank,
                                     self.cfg.requeue_exit_code).start()
        try:
            yield self
            self.manager.wait()
        except BaseException:
            if self.watchdog is not None and self.watchdog.fired:
                self.watchdog.exit_now()  # a peer's hard exit broke a collective: exit like the watchdog would
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.signals is not None:
                self.signals.armed = False
            if owned is not None:
                owned.restore()

    def step_done(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def stop_requested(self) -> bool:
        """Every rank: True when any rank caught SIGTERM/SIGUSR1 (they all agree on this step)."""
        return self.signals is not None and self.signals.agreed_stop(self.device)

    @property
    def stop_reason(self) -> str:
        return self.signals.signal_name if self.signals is not None else ""
