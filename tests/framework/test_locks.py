"""Directory locks: a second training job or data build on a busy directory is refused at once, naming the holder;
a lock whose holder died (SIGKILL) is detected as stale and taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from framework.base.errors import DataError
from framework.base.locks import DirLock, build_locks
from framework.cli import main

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from framework.base.locks import {what}; lock = {call}; print('held', flush=True); "
        "time.sleep(120)")


def _holder(call: str, what: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(what=what, call=call)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_second_training_job_is_refused_then_a_stale_lock_is_taken_over(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    holder = _holder(f"DirLock(__import__('pathlib').Path({str(run / '.lock')!r}), what='training job').acquire()",
                     "DirLock")
    try:
        code = main(["train", str(REPO / "configs/smoke/tiny.yaml"), f"run.dir={run}", "train.steps=2"])
        err = capsys.readouterr().err
        assert code == 2 and f"pid {holder.pid}" in err and "busy" in err and "training job" in err
        assert not (run / "checkpoints").exists()  # refused before training wrote anything
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with DirLock(run / ".lock", what="training job") as lock:  # the kernel dropped the dead holder's flock
        assert lock._fd is not None
    assert (run / ".lock").read_text() == ""  # released: the next holder will not report a stale lock


def test_build_locks_per_stage_and_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    holder = _holder(f"build_locks(__import__('pathlib').Path({str(tmp_path)!r}), ['tokenize'], 0)", "build_locks")
    try:
        with pytest.raises(DataError, match=rf"stage 'tokenize' task 0 holds .*pid {holder.pid}"):
            build_locks(tmp_path, ["ingest", "tokenize"], 0)
        other = build_locks(tmp_path, ["tokenize"], 1)  # another array task of the same build runs alongside
        other.release()
        assert build_locks(tmp_path, ["ingest"], 0).locks  # the failed attempt released what it had taken
        # `tessera data build` itself on the busy output_dir: refused before any stage runs, naming the holder.
        src = tmp_path / "src"
        src.mkdir()
        (src / "a.txt").write_text("some text " * 50)
        config = tmp_path / "build.yaml"
        config.write_text(f"output_dir: {tmp_path}\nsources:\n  - name: a\n    path: {src}\n    format: text\n"
                          f"    glob: '*.txt'\ntokenizer: {{vocab_size: 300}}\n")
        assert main(["data", "build", str(config), "--stages", "tokenize", "--task", "0", "--tasks", "1"]) == 2
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and "tokenize" in err, err
        assert not (tmp_path / "a").exists() and not (tmp_path / "manifest.json").exists()  # nothing was built
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    build_locks(tmp_path, ["tokenize"], 0).release()
