"""SIGTERM / SIGUSR1 / SIGINT handling: catch on any rank, agree on the stop step, save, exit with the right code.

SLURM sends SIGUSR1 shortly before the time limit (`#SBATCH --signal=USR1@<seconds>`) and SIGTERM on
preemption or `scancel`; either may reach only some ranks. A person's Ctrl-C is SIGINT. Inside the training
loop the handler only sets a flag. At every step boundary all ranks all-reduce the flag with MAX, so they agree
on the same stop step even when one rank alone saw the signal; the trainer then saves (blocking), and once the
checkpoint has committed every rank exits with

- `checkpoint.requeue_exit_code` (REQUEUE_EXIT_CODE = 42) after SIGTERM/SIGUSR1: launch/slurm requeues on it;
- 130 (INTERRUPT_EXIT_CODE, the shell's code for SIGINT) after Ctrl-C, so SLURM does not requeue it.

A second SIGINT while the first is pending aborts at once with one line and no checkpoint. Outside the loop
(setup, data preparation) there is nothing to save, so a signal raises `StopSignal` there; `tessera` turns it
into one line and the same exit code.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from framework.checkpoint.config import REQUEUE_EXIT_CODE

if TYPE_CHECKING:
    import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPT_EXIT_CODE = 130

# Vote values, all-reduced with MAX: a requeue request wins over an interrupt so a preempted job is requeued.
NO_STOP, INTERRUPT, REQUEUE = 0, 1, 2


def stop_kind(signum: int) -> int:
    return INTERRUPT if signum == signal.SIGINT else REQUEUE


class RunStopped(BaseException):
    """A command stops early on purpose with `exit_code` (requeue or 130), e.g. a driver whose run was signalled:
    it must not go on to its next run. A BaseException, like KeyboardInterrupt, so that `except Exception` in
    library code does not swallow it; `tessera` prints the message as one line and exits with the code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole: a data stage's forked unit sends it to its parent
        return (type(self), (str(self), self.exit_code))


class StopSignal(RunStopped):
    """A stop signal arrived outside the training loop (nothing to save)."""

    def __init__(self, signum: int, requeue_exit_code: int) -> None:
        code = INTERRUPT_EXIT_CODE if stop_kind(signum) == INTERRUPT else requeue_exit_code
        super().__init__(f"stopped by {signal.Signals(signum).name} before anything needed saving; exit code "
                         f"{code}", code)
        self.signum = signum
        self.requeue_exit_code = requeue_exit_code

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.signum, self.requeue_exit_code))


def check_stopped(exit_code: int, what: str) -> None:
    """A driver's guard after each run: raise RunStopped when the run ended on a stop signal (nonzero code)."""
    if exit_code:
        raise RunStopped(f"{what} stopped on a signal (its checkpoint is committed); exit code {exit_code}; run "
                         f"the same command again to continue where it stopped", exit_code)


_ACTIVE: list[StopSignals] = []
"""The handlers installed in this process (signal dispositions are per process)."""


def active() -> StopSignals | None:
    return _ACTIVE[-1] if _ACTIVE else None


class StopSignals:
    """Installs handlers for SIGTERM, SIGUSR1 and SIGINT; `agreed_stop()` is the step-boundary vote.

    While `armed` (the training loop) a signal sets a flag; otherwise it raises `StopSignal` at once.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS, armed: bool = True) -> None:
        self.signals = signals
        self.armed = armed
        self.requeue_exit_code = REQUEUE_EXIT_CODE
        """checkpoint.requeue_exit_code of the run (set once the config is loaded)."""
        self.received: int | None = None
        self.kind = NO_STOP
        self.agreed = NO_STOP
        self.agreed_signal = 0
        self.requested_by = ""
        """Why this process asked for the stop itself (`request`), when no signal did."""
        self._previous: dict[signal.Signals, Any] = {}
        self._pid = os.getpid()

    def install(self) -> StopSignals:
        """Install the handlers (main thread only; elsewhere signals cannot be caught and this is a no-op)."""
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            _ACTIVE.append(self)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            # Inherited through fork by a worker that has not set its own dispositions yet (a pool's exit can
            # SIGTERM a worker still starting, before its initializer runs): the process that installed the
            # handlers handles stops; the worker takes the signal's default action, as it would without Tessera.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not self.armed:
            raise StopSignal(signum, self.requeue_exit_code)
        if signum == signal.SIGINT and self.kind == INTERRUPT:
            os.write(2, b"tessera: second interrupt: aborting now, without a checkpoint\n")
            os._exit(INTERRUPT_EXIT_CODE)
        self._vote(signum)

    def _vote(self, signum: int) -> None:
        if self.received is None or stop_kind(signum) > self.kind:
            self.received = signum
        self.kind = max(self.kind, stop_kind(signum))

    def request(self, why: str, signum: int = signal.SIGUSR1) -> None:
        """Stop at the next step boundary as if `signum` had arrived (commit a checkpoint, exit with its code):
        a decision of the run itself, e.g. the node-exclusion policy (framework/observe/exclusion.py)."""
        self.requested_by = why
        self._vote(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def agreed_stop(self, device: torch.device | None = None) -> bool:
        """True on every rank when any rank has received a stop signal (all-reduce MAX of the vote)."""
        import torch
        import torch.distributed as dist

        flag, signum = self.kind, self.received or 0
        if dist.is_available() and dist.is_initialized():
            # The signal number travels with the vote, so the rank that logs the stop (rank 0) can name a signal
            # that only a peer caught.
            t = torch.tensor([flag, signum], dtype=torch.int32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag, signum = int(t[0].item()), int(t[1].item())
        self.agreed, self.agreed_signal = flag, signum
        return flag > NO_STOP

    @property
    def exit_code(self) -> int:
        """The code every rank exits with after the agreed stop."""
        return INTERRUPT_EXIT_CODE if self.agreed == INTERRUPT else self.requeue_exit_code

    @property
    def signal_name(self) -> str:
        if self.requested_by:
            return self.requested_by
        if self.received is not None and stop_kind(self.received) == self.agreed:
            return signal.Signals(self.received).name
        if self.agreed_signal and stop_kind(self.agreed_signal) == self.agreed:
            return f"{signal.Signals(self.agreed_signal).name} (caught by a peer rank)"
        return "a peer rank's signal"
