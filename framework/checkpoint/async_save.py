"""Asynchronous checkpoint saves: stage a copy at the step boundary, write and commit from a background thread.

(The module is not called `async.py` because `async` is a Python keyword: `import framework.checkpoint.async`
would be a syntax error.)

The training thread pays only for the copy of its state into host memory (`framework/checkpoint/staging.py`: a
reusable, pinned where it fits, buffer set; the device holds no second copy); the background thread selects the
training thread's device (a thread starts on device 0, and anything CUDA the writer touches would run there) and
runs `dcp.save` and the commit on a process group of its own — gloo, also next to NCCL — so the save's collectives
never interleave with training's on the same communicator. At most one save is in flight: a new save first waits
for the previous one, and an error in the background surfaces at the next `wait`/`save` on the training thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from framework.base.errors import CheckpointError
from framework.checkpoint import dcp as ckpt
from framework.checkpoint.staging import HostStager

DEFAULT_PIN_BUDGET = 16 << 30


def current_accelerator() -> torch.device | None:
    """The CUDA device the calling thread computes on (None without CUDA)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def select_device(device: torch.device | None) -> None:
    """Make `device` current on the calling thread (a new thread starts on CUDA device 0)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def new_checkpoint_group() -> dist.ProcessGroup | None:
    """A process group over every rank just for checkpoint traffic (gloo); None without torch.distributed.

    Every rank must call this, in the same order relative to other group creations.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


class AsyncSaver:
    """One background writer thread; `save` returns as soon as the state is staged."""

    def __init__(self, pg: dist.ProcessGroup | None, pin_budget_bytes: int = DEFAULT_PIN_BUDGET) -> None:
        self.pg = pg
        self.stager = HostStager(pin_budget_bytes)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done_step: int | None = None
        self.in_flight_step: int | None = None

    def save(self, root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], *, keep_last: int,
             keep_every: int, on_commit: Callable[[Path], None] | None = None) -> None:
        """Stage `state` and write + commit checkpoint `step` in the background (waits for the previous save)."""
        self.wait()
        tmp = ckpt.begin_save(root, step, self.pg)  # RNG states are captured here, at the step boundary
        staged = self.stager.stage(state)  # on this thread: complete host copies before training goes on
        device = current_accelerator()

        def work() -> None:
            try:
                select_device(device)
                ckpt.write_shards(staged, tmp, self.pg)
                path = ckpt.commit(root, step, meta, self.pg, keep_last=keep_last, keep_every=keep_every)
                if on_commit is not None:
                    on_commit(path)
                self._done_step = step
            except BaseException as err:  # re-raised on the training thread at the next wait()
                self._error = err

        self.in_flight_step = step
        self._thread = threading.Thread(target=work, name=f"tessera-ckpt-step{step}", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> int | None:
        """Block until the save in flight (if any) has committed; return its step. Re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.in_flight_step = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CheckpointError):  # already names the path and the cause
                raise CheckpointError(f"the asynchronous checkpoint save failed: {err}") from err
            raise CheckpointError(f"the asynchronous checkpoint save failed: {err!r}; the previous checkpoint "
                                  f"stays `latest`") from err
        return self._done_step
