"""A LockSet whose later lock is busy releases the locks it already took, by itself: the test keeps references to
every lock object (and to the exception, whose traceback holds the LockSet), so garbage collection cannot be
what frees them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from framework.base.errors import DataError
from framework.base.locks import DirLock, LockSet


def test_a_failed_lock_set_releases_what_it_took_while_referenced(tmp_path: Path) -> None:
    busy = DirLock(tmp_path / "b.lock", what="stage b", error=DataError).acquire()  # another open file: flock conflicts
    wanted = [DirLock(tmp_path / f"{name}.lock", what=f"stage {name}", error=DataError) for name in ("a", "b", "c")]
    gc.disable()  # nothing may be collected between the failure and the checks below
    try:
        with pytest.raises(DataError, match=r"stage b holds") as failure:
            LockSet(wanted)
        assert failure.value.__traceback__ is not None  # the LockSet's frame stays reachable through it
        # 'a' was taken and must have been given back: a fresh holder gets it at once
        again = DirLock(tmp_path / "a.lock", what="stage a", error=DataError).acquire()
        again.release()
        assert all(lock._fd is None for lock in wanted)  # nothing left open either ('c' never tried)
    finally:
        gc.enable()
        busy.release()
    # negative control: while a LockSet does hold 'a', a fresh holder is refused
    held = LockSet([DirLock(tmp_path / "a.lock", what="stage a", error=DataError)])
    with pytest.raises(DataError, match=r"stage a holds"):
        DirLock(tmp_path / "a.lock", what="stage a", error=DataError).acquire()
    held.release()
