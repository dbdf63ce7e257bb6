"""Real signals through `tessera launch local --nproc 2`: every stop commits one checkpoint, leaves no process,
exits with the right code, and the resumed losses equal an uninterrupted run bitwise.

One run directory is interrupted again and again (each rerun is the next case), so the 8 cases cost 9 launches:
SIGTERM, SIGUSR1 and SIGINT each to the launcher and to one rank, at seeded steps; SIGTERM to the launcher in the
middle of a checkpoint save (tests/launch/signal_site: rank 1 signals its launcher from inside the save); a
double Ctrl-C, which aborts at once without a checkpoint. The last launch finishes the run.
"""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

import pytest

from framework.checkpoint import REQUEUE_EXIT_CODE
from framework.testing.signals import ROOT, Launch, checkpoint_state, local_argv, losses, processes_left, rank_pid

TINY = str(ROOT / "configs" / "smoke" / "tiny.yaml")
STEPS, INTERVAL = 30, 4
COMMON = (f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}", "train.warmup_steps=2", "data.seed=7",
          "train.eval_interval=0", "train.log_interval=1")
INTERRUPTED = 130


def two_ranks(run: Path, log: Path, env: dict[str, str] | None = None) -> Launch:
    """One `tessera launch local --nproc 2` of the tiny run in the background."""
    return Launch(local_argv(2, TINY, run, COMMON), run, log, env)


def committed(run: Path) -> int:
    step, partial = checkpoint_state(run)
    assert not partial, f"partial checkpoints left: {partial}"
    assert step is not None, f"no committed checkpoint in {run}"
    return step


def assert_no_process_left(run: Path) -> None:
    left = processes_left(run, within_s=20)
    assert not left, f"processes of {run} still alive 20 s after the launcher exited: {left}"


@pytest.mark.slow
@pytest.mark.distributed
def test_signals_through_launch_local(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    first = two_ranks(ref, tmp_path / "ref.log")
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
        launch = two_ranks(run, tmp_path / f"case{i}.log")
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
    launch = two_ranks(run, tmp_path / "in_save.log", {"TESSERA_TEST_SIGNAL_IN_SAVE": f"{save_step}:SIGTERM"})
    assert launch.wait() == REQUEUE_EXIT_CODE, launch.output()[-4000:]
    assert committed(run) == save_step == max(losses(run)), launch.output()[-4000:]
    commits = re.findall(r"checkpoint \S+/step_(\d+) committed", launch.output())
    assert commits == [str(save_step)], launch.output()[-4000:]  # no second save of the stop step
    assert_no_process_left(run)

    # A second Ctrl-C aborts at once, in one line, without saving; the next start resumes from the last commit.
    # Two SIGINTs sent before the launcher runs are one pending signal (the kernel does not queue them): the second
    # is sent once the launcher has handled the first, while the ranks' stop checkpoint is still being written.
    launch = two_ranks(run, tmp_path / "double.log", {"TESSERA_TEST_SAVE_SLEEP_S": "3"})
    launch.wait_for_step(save_step + 1)
    os.kill(launch.proc.pid, signal.SIGINT)
    launch.wait_for_output("got SIGINT: forwarded")
    os.kill(launch.proc.pid, signal.SIGINT)
    assert launch.wait() == INTERRUPTED and "Traceback" not in launch.output(), launch.output()[-4000:]
    assert "second interrupt" in launch.output()
    assert_no_process_left(run)

    last = two_ranks(run, tmp_path / "last.log")
    assert last.wait() == 0, last.output()[-4000:]
    assert losses(run) == reference  # bitwise: exact floats from JSON
