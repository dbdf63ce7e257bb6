"""`tessera train` with one injected fault, for the checkpoint tests (real processes, real signals).

    python tests/checkpoint/fault_worker.py FAULT CONFIG [overrides...]

FAULT is:
    kill-in-commit:N   SIGKILL this process while committing the checkpoint of step N (shards and meta.json are
                       written, the manifest and the rename are not): a kill in the middle of a save.
"""

from __future__ import annotations

import os
import signal
import sys
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
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    from framework.cli import main as cli_main

    return cli_main(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
