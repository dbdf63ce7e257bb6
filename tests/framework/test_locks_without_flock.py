"""Directory locks on a filesystem without flock (some parallel filesystems answer ENOLCK): the holder file decides.
A live holder on this host is refused, a dead one is taken over (and named in the log), a holder on another host
is refused with the command that clears it; the lock directory is created with its parents."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from framework.base.errors import DataError
from framework.base.locks import DirLock


@pytest.fixture
def no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    def flock(fd: int, op: int) -> None:
        if op & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)


def _holder_file(path: Path, host: str, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "since": "2026-12-06 01:02:03"}))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.usefixtures("no_flock")
def test_without_flock_the_holder_file_decides(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lock_path = tmp_path / "out" / ".locks" / "tokenize.task0.lock"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _holder_file(lock_path, socket.gethostname(), live.pid)
        with pytest.raises(DataError, match=rf"busy: .*pid {live.pid} .*wait for it to finish"):
            DirLock(lock_path, what="data build", error=DataError).acquire()
    finally:
        live.kill()
        live.wait()

    dead = _dead_pid()
    _holder_file(lock_path, socket.gethostname(), dead)
    with caplog.at_level(logging.WARNING, logger="tessera.locks"):
        lock = DirLock(lock_path, what="data build", error=DataError).acquire()
    assert f"taking over the stale data build lock {lock_path} left by host {socket.gethostname()} pid {dead}" \
        in caplog.text
    assert json.loads(lock_path.read_text())["pid"] == os.getpid()
    lock.release()
    assert lock_path.read_text() == ""

    caplog.clear()  # a holder file without a pid (written by hand, or emptied): taken, nothing to report
    lock_path.write_text("{}")
    with caplog.at_level(logging.WARNING, logger="tessera.locks"):
        DirLock(lock_path, what="data build", error=DataError).acquire().release()
    assert "stale" not in caplog.text

    lock_path.write_text(json.dumps({"host": socket.gethostname()}))  # this host, pid unreadable: not provably dead
    with pytest.raises(DataError, match=r"busy"):
        DirLock(lock_path, what="data build", error=DataError).acquire()

    _holder_file(lock_path, "another-node-17", 4242)
    with pytest.raises(DataError, match=rf"host another-node-17 pid 4242 .*no flock.*rm {lock_path}"):
        DirLock(lock_path, what="data build", error=DataError).acquire()


def test_a_lock_creates_its_missing_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c" / ".lock"
    with DirLock(path, what="training job") as lock:
        assert lock._fd is not None and path.is_file()
