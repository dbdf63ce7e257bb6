"""Hang watchdog: when no step completes in time, dump every thread's Python stack and exit to be requeued.

Each rank runs its own watchdog thread. A rank that stalls stops beating, and so do its peers, which block in
the next collective waiting for it: every rank's watchdog fires, each writes `stacks/rank_R.txt` into the run
directory with `faulthandler` (the stalled rank's stack names the culprit; the others show the collective they
wait in), waits a short grace so slower peers can dump too, and exits with the requeue exit code. The training
process group's collective timeout (checkpoint.collective_timeout_s) must be longer than the watchdog's, so a
hang is reported by stacks rather than by a collective error. Beside the stacks, each rank writes torch's flight
record (its last collectives per process group) to `nccl_trace/rank_R.watchdog`, from which `tessera doctor` names
the collective, the group and the rank that never issued it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import threading
import time
from pathlib import Path

from framework.base.logs import get_logger

log = get_logger("watchdog")


def dump_flight_record(path: Path) -> bool:
    """Write torch's flight record of this rank (its last collectives; on gloo too) with the group table (name ->
    description and global member ranks) beside it, for `tessera doctor` (framework/observe/flight.py). False when
    the recorder is off (TORCH_FR_BUFFER_SIZE unset) or unavailable."""
    try:
        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]  # no stub

        record = pickle.loads(_dump_fr_trace())
        if not record.get("entries"):
            return False
        world = dist.distributed_c10d._world
        record["groups"] = {name: {"desc": getattr(pg, "group_desc", ""), "ranks": dist.get_process_group_ranks(pg)}
                            for pg, name in world.pg_names.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(record))
        return True
    except Exception as exc:  # forensics must never turn a hang into a crash
        log.warning("no flight record written to %s: %s", path, exc)
        return False


class Watchdog:
    """Background thread that fires when `beat()` was not called for `timeout_s` seconds."""

    def __init__(self, timeout_s: float, dump_dir: Path, rank: int, exit_code: int, grace_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self.dump_dir = dump_dir
        self.rank = rank
        self.exit_code = exit_code
        self.grace_s = grace_s
        self.fired = False
        self._last = time.monotonic()
        self._step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-watchdog", daemon=True)

    @property
    def dump_file(self) -> Path:
        return self.dump_dir / f"rank_{self.rank}.txt"

    def start(self) -> Watchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """A step completed: reset the timer."""
        self._last = time.monotonic()
        self._step = step

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self.fire(idle)

    def dump(self, idle_s: float) -> Path:
        """Write every thread's Python stack of this process to `stacks/rank_R.txt`."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        with self.dump_file.open("w") as f:
            f.write(f"rank {self.rank} pid {os.getpid()}: no step completed for {idle_s:.1f} s "
                    f"(checkpoint.watchdog_timeout_s={self.timeout_s:g}); last completed step {self._step}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        dump_flight_record(self.dump_dir.parent / "nccl_trace" / f"rank_{self.rank}.watchdog")
        return self.dump_file

    def fire(self, idle_s: float) -> None:
        """Dump the stacks, let peers dump theirs, and exit the process with the requeue code."""
        self.fired = True
        path = self.dump(idle_s)
        log.error("hang watchdog: no step for %.1f s; stacks written to %s; exiting with code %d",
                  idle_s, path, self.exit_code)
        self.exit_now(self.grace_s)

    def exit_now(self, after_s: float = 0.0) -> None:
        time.sleep(after_s)
        for handler in logging.getLogger("tessera").handlers:
            handler.flush()
        os._exit(self.exit_code)  # the main thread is stuck: only a hard exit ends the process
