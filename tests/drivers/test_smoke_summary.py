"""`tessera smoke --nproc 1` end to end on the tiny synthetic config: stop half-way, resume, print the summary; a
smoke job stopped by SIGTERM exits with the requeue code and the same command continues where it stopped."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from framework.checkpoint import REQUEUE_EXIT_CODE
from framework.drivers.smoke import SMOKE_MARKER, run_smoke
from framework.testing.signals import Launch, checkpoint_state, losses

REPO = Path(__file__).resolve().parents[2]


def test_single_process_smoke_stops_resumes_and_summarises(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    overrides = [f"run.dir={tmp_path / 'run'}", "train.steps=6", "train.eval_interval=3", "train.eval_batches=1",
                 "checkpoint.interval=3"]
    code = run_smoke(str(REPO / "configs/smoke/tiny.yaml"), overrides, nproc=1)
    out = capsys.readouterr().out
    assert "steps             : 0 -> 3 (stop), resumed -> 6" in out
    val = re.search(r"validation loss   : (.*)", out)
    assert val is not None
    names = [part.rsplit(" ", 1)[0] for part in val.group(1).split(", ")]
    assert names == sorted(set(names), key=names.index), f"a validation name is printed twice: {names}"
    first, final = (float(re.search(rf"{k} loss\s*: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
                    for k in ("first logged", "final"))
    assert code == (0 if final <= 0.6 * first else 1)
    assert (tmp_path / "run" / "checkpoints" / "step_6").is_dir()


def test_a_stopped_smoke_job_continues_where_it_stopped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    config = str(REPO / "configs/smoke/tiny.yaml")
    overrides = [f"run.dir={run}", "train.steps=10", "train.eval_interval=0", "checkpoint.interval=2",
                 "train.log_interval=1"]
    argv = [sys.executable, "-m", "framework.cli", "smoke", "--nproc", "1", "--config", config, *overrides]
    first = Launch(argv, run, tmp_path / "first.log")
    first.wait_for_step(2)
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.wait() == REQUEUE_EXIT_CODE, first.output()[-3000:]
    assert "run the same command again to continue" in first.output()
    stopped, partial = checkpoint_state(run)
    assert stopped is not None and 2 <= stopped <= 4 and not partial, first.output()[-3000:]
    before = losses(run)
    assert (run / SMOKE_MARKER).is_file()

    run_smoke(config, overrides, nproc=1)
    out = capsys.readouterr().out
    assert f"continuing the stopped smoke job in {run}" in out
    assert f"resumed from step_{stopped}" in (run / "train.log").read_text()
    after = losses(run)
    assert sorted(after) == list(range(1, 11))  # every step once: nothing redone, nothing skipped
    assert all(after[s] == before[s] for s in range(1, stopped + 1))  # the steps before the stop were kept
    assert not (run / SMOKE_MARKER).exists()  # finished: the next smoke job starts fresh
    run_smoke(config, overrides, nproc=1)
    assert "continuing" not in capsys.readouterr().out and sorted(losses(run)) == list(range(1, 11))
