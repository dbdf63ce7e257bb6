"""Build-once caching shared by every process: a file lock for the builder, a 'done' marker for the others.

A build is written into a temporary directory and renamed into place when complete, so its final directory
existing (with its manifest) is the atomic 'done' marker. Builders serialize on an flock; ranks that are not
builders only poll for the marker, so a multi-rank job builds once and never reads half-written files.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from framework.base.errors import DataError

MANIFEST = "manifest.json"


def config_key(obj: Any) -> str:
    """A short, stable hash of a JSON-able build description."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `path` (created if needed), released on exit or process death."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def wait_for(marker: Path, timeout_s: float, what: str) -> None:
    """Poll until `marker` exists; raise DataError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while not marker.exists():
        if time.monotonic() > deadline:
            raise DataError(f"waited {timeout_s:.0f} s for {what} ({marker}) and it never appeared; the builder "
                            f"rank (is_builder=True) must run prepare_data too — or raise data.wait_timeout_s")
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def build_once(final_dir: Path, build: Callable[[Path], None], *, is_builder: bool, timeout_s: float) -> Path:
    """Return `final_dir`, building it with `build(tmp_dir)` first unless a complete copy exists.

    Args:
        final_dir: Where the finished build lives; complete once `final_dir/manifest.json` exists.
        build: Writes a complete build (including its manifest) into the directory it is given.
        is_builder: False: never build, wait for another process's build instead.
        timeout_s: How long a non-builder waits.
    """
    marker = final_dir / MANIFEST
    if marker.is_file():
        return final_dir
    if not is_builder:
        wait_for(marker, timeout_s, f"the data build {final_dir.name}")
        return final_dir
    with file_lock(final_dir.parent / f".{final_dir.name}.lock"):
        if marker.is_file():  # another builder finished while we waited for the lock
            return final_dir
        tmp = final_dir.parent / f".{final_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            build(tmp)
            if not (tmp / MANIFEST).is_file():
                raise DataError(f"the build into {tmp} finished without writing {MANIFEST}")
            shutil.rmtree(final_dir, ignore_errors=True)  # a stale, incomplete copy
            tmp.rename(final_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final_dir


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON under a temporary name, then rename (readers never see a partial file)."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    tmp.replace(path)
