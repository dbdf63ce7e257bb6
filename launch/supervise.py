"""Run N rank processes and never leave one behind: forward stop signals, bound every wait, combine exit codes.

    code = supervise([argv] * n, [env_of(rank) for rank in range(n)], requeue_exit_code=42)

- Each rank starts in its own session, so a terminal's Ctrl-C reaches only this process, which forwards it once
  (a rank treats a second SIGINT as "abort now"); each rank also gets SIGTERM if this process dies, even by
  SIGKILL (Linux `PR_SET_PDEATHSIG`), so no rank outlives its launcher.
- SIGTERM, SIGUSR1 and SIGINT are forwarded to every live rank; the ranks agree on a stop step, commit one
  checkpoint and exit. Whatever is still running `grace_s` later is killed. A second SIGINT kills every rank
  at once and exits 130 with one line.
- When a rank fails, its peers are usually stuck in a collective: they get `peer_grace_s` to fail on their own
  (so their tracebacks are printed), then they are killed.
- The exit code is the ranks': the first failure's, else 130 after an interrupt, else the requeue code, else 0.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import IO, Any

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPT_EXIT_CODE = 130
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM when the launcher dies (Linux); exit if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the signal forwarding below still applies
        return
    if os.getppid() != parent:
        os._exit(1)


def exit_code_of(returncode: int) -> int:
    """A Popen return code as a shell exit code (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def combined_exit_code(codes: Sequence[int], requeue_exit_code: int) -> int:
    """The ranks' exit codes (in the order they exited) as one: the first failure, else 130, requeue, 0."""
    shell = [exit_code_of(c) for c in codes]
    failures = [c for c in shell if c not in (0, requeue_exit_code, INTERRUPT_EXIT_CODE)]
    if failures:
        return failures[0]
    for code in (INTERRUPT_EXIT_CODE, requeue_exit_code):
        if code in shell:
            return code
    return 0


def _say(message: str) -> None:
    print(f"[tessera launch] {message}", file=sys.stderr, flush=True)


class Supervisor:
    """The rank processes of one launch and the launcher's signal handlers while they run."""

    def __init__(self, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], *, grace_s: float,
                 peer_grace_s: float, requeue_exit_code: int, cwd: str | None = None,
                 output: IO[Any] | None = None) -> None:
        self.commands = list(zip(argvs, envs, strict=True))
        self.cwd, self.output = cwd, output
        self.procs: list[subprocess.Popen[bytes]] = []
        self.grace_s, self.peer_grace_s = grace_s, peer_grace_s
        self.requeue_exit_code = requeue_exit_code
        self.pending: list[int] = []
        self.interrupted = False
        self.deadline: float | None = None
        self.order: list[int] = []  # ranks in the order they exited
        self.exited: list[int] = []  # their return codes
        self.killed: set[int] = set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)

    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _kill_all(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.killed.add(i)
                p.kill()
        for p in self.procs:
            p.wait()

    def _handle_pending(self) -> bool:
        """Forward the signals received since the last poll; False after a second SIGINT (all killed)."""
        while self.pending:
            sig = self.pending.pop(0)
            if sig == signal.SIGINT and self.interrupted:
                _say("second interrupt: killing every rank now, without a checkpoint")
                self._kill_all()
                return False
            self.interrupted |= sig == signal.SIGINT
            _say(f"got {signal.Signals(sig).name}: forwarded to every rank; they save and stop "
                 f"(killed after {self.grace_s:g} s)")
            self._send(sig)
            if self.deadline is None:
                self.deadline = time.monotonic() + self.grace_s
        return True

    def _poll(self) -> None:
        """Record ranks that exited since the last poll; a failure starts the peers' deadline."""
        for i, p in enumerate(self.procs):
            if p.poll() is None or i in self.order:
                continue
            self.order.append(i)
            self.exited.append(p.returncode)
            code = exit_code_of(p.returncode)
            if code not in (0, self.requeue_exit_code, INTERRUPT_EXIT_CODE) and self.deadline is None:
                _say(f"rank {i} exited with code {code}; stopping the others (killed after {self.peer_grace_s:g} s)")
                self.deadline = time.monotonic() + self.peer_grace_s

    def run(self) -> int:
        """Wait for every rank (forwarding signals, enforcing the deadlines); the combined exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED}
        me = os.getpid()
        try:
            for argv, env in self.commands:
                self.procs.append(subprocess.Popen(
                    list(argv), env=env, cwd=self.cwd, start_new_session=True, stdout=self.output,
                    stderr=subprocess.STDOUT if self.output is not None else None,
                    preexec_fn=lambda: _die_with_parent(me)))
            while True:
                if not self._handle_pending():
                    return INTERRUPT_EXIT_CODE
                self._poll()
                if len(self.order) == len(self.procs):
                    break
                if self.deadline is not None and time.monotonic() > self.deadline:
                    alive = [i for i, p in enumerate(self.procs) if p.poll() is None]
                    _say(f"rank(s) {alive} still running past the deadline: killed")
                    self._kill_all()
                    self._poll()
                    break
                time.sleep(0.05)
        except BaseException:
            self._kill_all()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.killed:
            codes = [c for i, c in zip(self.order, self.exited, strict=True) if i not in self.killed]
            code = combined_exit_code(codes, self.requeue_exit_code)
            return code or 128 + signal.SIGKILL
        return combined_exit_code(self.exited, self.requeue_exit_code)


def supervise(argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], *, grace_s: float = 120.0,
              peer_grace_s: float = 30.0, requeue_exit_code: int = 42, cwd: str | None = None,
              output: IO[Any] | None = None) -> int:
    """Start one process per (argv, env), supervise them to the end; return their combined exit code.

    `output`: a file that receives every rank's stdout and stderr (default: this process's own).
    """
    return Supervisor(argvs, envs, grace_s=grace_s, peer_grace_s=peer_grace_s,
                      requeue_exit_code=requeue_exit_code, cwd=cwd, output=output).run()
