"""`tessera train` with one injected fault, for the checkpoint tests (real processes, real signals).

    python tests/checkpoint/fault_worker.py FAULT CONFIG [overrides...]

FAULT is one of:
    kill-in-commit:N   SIGKILL this process while committing the checkpoint of step N (shards and meta.json are
                       written, the manifest and the rename are not): a kill in the middle of a save.
    stall:R:N          rank R sleeps for an hour in step N (a hang for the watchdog to catch).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    fault, rest = argv[0], argv[1:]
    kind, *args = fault.split(":")
    if kind == "kill-in-commit":
        from pathlib import Path

        from framework.checkpoint import dcp

        doomed = f"{dcp.TMP_PREFIX}{dcp.step_dir_name(int(args[0]))}"
        real_write_manifest = dcp.write_manifest

        def write_manifest(ckpt_dir: Path) -> dict[str, Any]:
            if ckpt_dir.name == doomed:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write_manifest(ckpt_dir)

        dcp.write_manifest = write_manifest  # type: ignore[assignment]
    elif kind == "stall":
        from framework.train.trainer import Trainer

        stall_rank, stall_step = int(args[0]), int(args[1])
        real_step = Trainer.train_step

        def train_step(self: Trainer) -> dict[str, Any]:
            if self.rank == stall_rank and self.step + 1 == stall_step:
                time.sleep(3600)
            return real_step(self)

        Trainer.train_step = train_step  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    from framework.cli import main as cli_main

    return cli_main(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
