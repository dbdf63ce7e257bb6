"""Real-signal fault harness: start a run in the background, signal it at a step, and read what it left behind.

Shared by tests/launch/test_launch_signals.py (CI: 2 ranks) and bench/signal_matrix.py (the full matrix: 1
process, 2 and 4 ranks). A run is found by its `run.dir=...` argument in /proc, so every rank and launcher of it is
seen, whoever started it.

    launch = Launch(local_argv(2, config, run, overrides), run, log)
    launch.wait_for_step(5)
    os.kill(launch.proc.pid, signal.SIGTERM)
    code = launch.wait()
    step, partial = checkpoint_state(run)     # newest committed checkpoint, partial (.tmp-*) ones
    left = processes_left(run, within_s=20)   # what is still running 20 s later (killed, and returned)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIGNAL_SITE = ROOT / "tests" / "launch" / "signal_site"
"""sitecustomize that sends a real signal from inside a checkpoint save (TESSERA_TEST_SIGNAL_IN_SAVE)."""


def local_argv(nproc: int, config: str, run: Path, overrides: Sequence[str], grace_s: float = 60) -> list[str]:
    """`tessera launch local --nproc N` with one intra-op thread per rank."""
    return [sys.executable, "-m", "framework.cli", "launch", "local", "--nproc", str(nproc), "--threads", "1",
            "--grace", str(grace_s), config, f"run.dir={run}", *overrides]


def train_argv(config: str, run: Path, overrides: Sequence[str]) -> list[str]:
    """One `tessera train` process (no launcher)."""
    return [sys.executable, "-m", "framework.cli", "train", config, f"run.dir={run}", *overrides]


class Launch:
    """One command in the background, stdout and stderr to `log`, the signal hook importable."""

    def __init__(self, argv: Sequence[str], run: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.run, self.log = run, log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SIGNAL_SITE)]), "OMP_NUM_THREADS": "1",
               "TESSERA_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.output()[-4000:]}") from None

    def wait_for_output(self, text: str, timeout: float = 60) -> None:
        """Until `text` is in the log (e.g. the launcher's line saying its signal handler ran)."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None, f"exited before printing {text!r}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"{text!r} not printed:\n{self.output()[-4000:]}"
            time.sleep(0.01)

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while max(losses(self.run), default=0) < step:
            assert self.proc.poll() is None, f"exited early:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"step {step} not reached:\n{self.output()[-4000:]}"
            time.sleep(0.02)


def losses(run: Path) -> dict[int, float]:
    """Train loss by step from metrics.jsonl (a line being written is ignored)."""
    out: dict[int, float] = {}
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("type") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def processes_of(run: Path) -> list[int]:
    """PIDs of live processes whose command line names this run directory (any launcher or rank)."""
    needle = f"run.dir={run}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() and b"Z" not in (entry / "stat").read_bytes().split()[2]:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def rank_pid(run: Path, rank: int) -> int:
    """The PID of rank `rank`'s `tessera train` process of this run."""
    for pid in processes_of(run):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"framework.cli\0train" in cmdline:
            return pid
    raise AssertionError(f"rank {rank} of {run} not found")


def checkpoint_state(run: Path) -> tuple[int | None, list[str]]:
    """The step `latest` points at (None without one) and the names of partial (.tmp-*) checkpoints."""
    ckpts = run / "checkpoints"
    partial = sorted(p.name for p in ckpts.glob(".tmp-*"))
    latest = ckpts / "latest"
    step = int(latest.read_text().strip().removeprefix("step_")) if latest.exists() else None
    return step, partial


def processes_left(run: Path, within_s: float = 20) -> list[int]:
    """Wait up to `within_s` for every process of the run to end; kill and return those still alive."""
    deadline = time.monotonic() + within_s
    while (left := processes_of(run)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
