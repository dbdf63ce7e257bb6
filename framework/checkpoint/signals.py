"""SIGTERM / SIGUSR1 handling: catch on any rank, agree on the stop step, save, exit with the requeue code.

SLURM sends SIGUSR1 shortly before the time limit (`#SBATCH --signal=USR1@<seconds>`) and SIGTERM on
preemption or `scancel`; either may reach only some ranks. The handler only sets a flag. At every step
boundary all ranks all-reduce the flag with MAX, so they agree on the same stop step even when one rank alone
saw the signal; the trainer then saves (blocking), and once the checkpoint has committed every rank exits with
`checkpoint.requeue_exit_code` (REQUEUE_EXIT_CODE = 42), which launch/slurm requeues on.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Installs flag-setting handlers for SIGTERM and SIGUSR1; `agreed_stop()` is the step-boundary vote."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> StopSignals:
        """Install the handlers (main thread only; elsewhere signals cannot be caught and this is a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed_stop(self, device: torch.device | None = None) -> bool:
        """True on every rank when any rank has received a stop signal (all-reduce MAX of the flag)."""
        flag = 1 if self.received is not None else 0
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([flag], dtype=torch.int32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        return flag > 0

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a peer rank's signal"
