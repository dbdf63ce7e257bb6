"""Real signals through `tessera launch local --nproc 2`: every stop commits one checkpoint, leaves no process,
exits with the right code, and the resumed losses equal an uninterrupted run bitwise.

One run directory is interrupted again and again (each rerun is the next case), so the 8 cases cost 9 launches:
SIGTERM, SIGUSR1 and SIGINT each to the launcher and to one rank, at seeded steps; SIGTERM to the launcher in the
middle of a checkpoint save (tests/launch/signal_site: rank 1 signals its launcher from inside the save); a
double Ctrl-C, which aborts at once without a checkpoint. The last launch finishes the run.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.checkpoint import REQUEUE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "smoke" / "tiny.yaml")
SITE = str(Path(__file__).with_name("signal_site"))
STEPS, INTERVAL = 30, 4
COMMON = (f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}", "train.warmup_steps=2", "data.seed=7",
          "train.eval_interval=0", "train.log_interval=1")
INTERRUPTED = 130


class Launch:
    """One `tessera launch local --nproc 2` in the background, output to a file."""

    def __init__(self, run: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.run, self.log = run, log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), SITE]), "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "framework.cli", "launch", "local", "--nproc", "2", "--threads", "1", "--grace",
             "60", TINY, f"run.dir={run}", *COMMON], cwd=ROOT, env=env, stdout=log.open("wb"),
            stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launcher still running after {timeout} s:\n{self.output()[-4000:]}") from None

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while max(losses(self.run), default=0) < step:
            assert self.proc.poll() is None, f"launcher exited early:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"step {step} not reached:\n{self.output()[-4000:]}"
            time.sleep(0.02)


def losses(run: Path) -> dict[int, float]:
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
    for pid in processes_of(run):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ and b"framework.cli\0train" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"rank {rank} of {run} not found")


def committed(run: Path) -> int:
    ckpts = run / "checkpoints"
    partial = sorted(p.name for p in ckpts.glob(".tmp-*"))
    assert not partial, f"partial checkpoints left: {partial}"
    return int((ckpts / "latest").read_text().strip().removeprefix("step_"))


def assert_no_process_left(run: Path) -> None:
    deadline = time.monotonic() + 20
    while (left := processes_of(run)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of {run} still alive 20 s after the launcher exited: {left}"


@pytest.mark.slow
@pytest.mark.distributed
def test_signals_through_launch_local(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    first = Launch(ref, tmp_path / "ref.log")
    assert first.wait() == 0, first.output()[-4000:]
    reference = losses(ref)
    assert sorted(reference) == list(range(1, STEPS + 1))

    run = tmp_path / "run"
    rng = random.Random(13)
    cases = [(signal.SIGTERM, "launcher", REQUEUE_EXIT_CODE), (signal.SIGUSR1, "rank", REQUEUE_EXIT_CODE),
             (signal.SIGINT, "launcher", INTERRUPTED), (signal.SIGTERM, "rank", REQUEUE_EXIT_CODE),
             (signal.SIGUSR1, "launcher", REQUEUE_EXIT_CODE), (signal.SIGINT, "rank", INTERRUPTED)]
    start = 0
    for i, (sig, target, want) in enumerate(cases):
        launch = Launch(run, tmp_path / f"case{i}.log")
        at = start + rng.randint(1, 2)
        launch.wait_for_step(at)
        os.kill(launch.proc.pid if target == "launcher" else rank_pid(run, 1), sig)
        code = launch.wait()
        out = launch.output()
        what = f"case {i}: {sig.name} to the {target} after step {at}:\n{out[-4000:]}"
        assert code == want, what
        stop = committed(run)
        assert at <= stop <= at + 2 and max(losses(run)) == stop, what  # one checkpoint, at the stop step
        assert f"stopping at step {stop} on" in out and "Traceback" not in out, what
        assert_no_process_left(run)
        start = stop

    # SIGTERM in the middle of the save of the next interval checkpoint: that checkpoint is the stop step.
    save_step = (start // INTERVAL + 1) * INTERVAL
    launch = Launch(run, tmp_path / "in_save.log", {"TESSERA_TEST_SIGNAL_IN_SAVE": f"{save_step}:SIGTERM"})
    assert launch.wait() == REQUEUE_EXIT_CODE, launch.output()[-4000:]
    assert committed(run) == save_step == max(losses(run)), launch.output()[-4000:]
    commits = re.findall(r"checkpoint \S+/step_(\d+) committed", launch.output())
    assert commits == [str(save_step)], launch.output()[-4000:]  # no second save of the stop step
    assert_no_process_left(run)

    # A second Ctrl-C aborts at once, in one line, without saving; the next start resumes from the last commit.
    launch = Launch(run, tmp_path / "double.log")
    launch.wait_for_step(save_step + 1)
    os.kill(launch.proc.pid, signal.SIGINT)
    time.sleep(0.01)
    os.kill(launch.proc.pid, signal.SIGINT)
    assert launch.wait() == INTERRUPTED and "Traceback" not in launch.output(), launch.output()[-4000:]
    assert "second interrupt" in launch.output()
    assert_no_process_left(run)

    last = Launch(run, tmp_path / "last.log")
    assert last.wait() == 0, last.output()[-4000:]
    assert losses(run) == reference  # bitwise: exact floats from JSON
