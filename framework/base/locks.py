"""Exclusive, non-blocking directory locks that name their holder: one training job per run directory, one data
build per (stage, task) of an output directory.

    with DirLock(run_dir / ".lock", what="training run", error=ConfigError):
        ...                                   # a second job gets the error at once, naming host, pid and start

The lock is an `flock` on a small file that holds the holder's host, pid and start time as JSON. The kernel
drops an flock when its process dies (SIGKILL and OOM included), so a lock left by a dead job is detected as
stale the next time: the new holder takes it over and logs whose it was. Where the filesystem has no flock
(some parallel filesystems), the holder's pid is checked on the same host; a lock from another host is then
reported with the command that clears it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from framework.base.errors import TesseraError

log = logging.getLogger("tessera.locks")


def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DirLock:
    """An exclusive lock file; `acquire()` raises `error` at once when another live process holds it."""

    def __init__(self, path: Path, *, what: str, error: type[TesseraError] = TesseraError) -> None:
        self.path = Path(path)
        self.what = what
        self.error = error
        self._fd: int | None = None

    def _read_holder(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.path.read_text() or "{}"))
        except (OSError, ValueError):
            return {}

    def _busy(self, holder: dict[str, Any], hint: str) -> TesseraError:
        who = (f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} (since {holder.get('since', '?')})"
               if holder else "another process")
        return self.error(f"{self.path.parent} is busy: another {self.what} holds {self.path}: {who}; {hint}")

    def acquire(self) -> DirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._busy(self._read_holder(), "wait for it to finish or stop it; two jobs must not share one "
                             "directory") from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            self._check_without_flock(fd)
        previous = self._read_holder()
        if previous and previous.get("pid") != os.getpid():
            log.warning("taking over the stale %s lock %s left by host %s pid %s (since %s), which is no longer "
                        "running", self.what, self.path, previous.get("host"), previous.get("pid"),
                        previous.get("since"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self._fd = fd
        return self

    def _check_without_flock(self, fd: int) -> None:
        """No flock on this filesystem: trust the holder file, checking the pid where it is on this host."""
        holder = self._read_holder()
        if not holder or holder.get("pid") == os.getpid():
            return
        if holder.get("host") == socket.gethostname():
            if _alive(int(holder.get("pid", -1))):
                os.close(fd)
                raise self._busy(holder, "wait for it to finish or stop it")
            return  # stale: its process is gone
        os.close(fd)
        raise self._busy(holder, f"this filesystem has no flock, so a holder on another host cannot be checked; if "
                                 f"no such job is running, clear the stale lock with: rm {self.path}")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class LockSet:
    """Several locks held together; released together (explicitly, or when the object goes away)."""

    def __init__(self, locks: list[DirLock]) -> None:
        self.locks: list[DirLock] = []
        try:
            for lock in locks:
                self.locks.append(lock.acquire())
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks.clear()

    def __del__(self) -> None:
        self.release()


def build_locks(output_dir: Path, stages: Sequence[str], task: int) -> LockSet:
    """One lock per (stage, task) of a data build's output directory (under `.locks/`, which nothing in a build
    deletes): the tasks of one SLURM array run side by side, two builds of the same stage and task do not.

    Raises:
        DataError: naming the holder of a busy stage.
    """
    from framework.base.errors import DataError

    return LockSet([DirLock(output_dir / ".locks" / f"{stage}.task{task}.lock", what=f"data build of stage {stage!r} "
                            f"task {task}", error=DataError) for stage in stages])
