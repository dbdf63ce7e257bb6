"""Which rank speaks, decided here once: rank 0 prints what every rank would print alike (INFO and WARNING lines,
the data's mixture lines, a configuration or data error); the other ranks print only errors of their own.

Every layer logs through `get_logger`; the trainer calls `setup_logging` once per run. Code that prints outside
logging asks `speaks()`; the CLI reports an error through `say_error`, which prints each distinct message once per
job. TESSERA_LOG_ALL_RANKS=1 makes every rank speak (debugging a desync).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TextIO

LOG_FORMAT = "%(asctime)s [%(levelname)s] %(rankprefix)s%(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}/{world}] " if world > 1 else ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rankprefix = self.prefix
        return True


def process_rank() -> int:
    """This process's rank in its job: torchrun's RANK (0 outside a distributed launch, e.g. a data build task)."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def speaks(rank: int | None = None) -> bool:
    """Whether this process prints lines every rank would print alike: rank 0 (or every rank with
    TESSERA_LOG_ALL_RANKS=1)."""
    return (process_rank() if rank is None else rank) == 0 or os.environ.get("TESSERA_LOG_ALL_RANKS") == "1"


_SAID: list[str] = []
STORE_GRACE_S = 5.0
"""How long rank 0, which hosts the store, waits for the other ranks to report their error before it exits."""


def _first_to_say(message: str) -> bool:
    """True on the first rank of the job to report `message` (a counter per message in the process group's
    store); True as well when that cannot be asked (no process group, or its store is gone), on rank 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(timedelta(seconds=10))
            # Keyed by this process's count of errors too: a later identical error of the same rank is new.
            _SAID.append(message)
            key = f"tessera/said/{len(_SAID)}/{hashlib.sha1(message.encode()).hexdigest()}"
            first = int(store.add(key, 1)) == 1
            reported = int(store.add(f"tessera/said/{len(_SAID)}", 1))
            if dist.get_rank() == 0:  # the store lives in this process: keep it up while the others ask it
                deadline = time.monotonic() + STORE_GRACE_S
                while reported < dist.get_world_size() and time.monotonic() < deadline:
                    time.sleep(0.05)
                    reported = int(store.add(f"tessera/said/{len(_SAID)}", 0))
            return first
        except Exception:  # the store (rank 0's process) is gone: say it rather than lose it
            return True
    return speaks()  # before the process group: every rank runs the same config checks


def say_error(message: str, stream: TextIO | None = None) -> None:
    """Print an error line once per job: identical messages of several ranks are printed by the first of them
    (prefixed with its rank when that is not 0); a message of one rank only is always printed."""
    if "torch.distributed" not in sys.modules and not speaks():
        return  # no process group can exist yet: the same config error is raised on every rank
    if "torch.distributed" in sys.modules and not _first_to_say(message):
        return
    rank = process_rank()
    prefix = f"[rank {rank}] " if rank and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    print(prefix + message, file=stream or sys.stderr, flush=True)


def setup_logging(rank: int = 0, world: int = 1, log_file: Path | None = None, all_ranks: bool = False) -> None:
    """Rank-aware logging: rank 0 logs INFO to the console (and the file); other ranks log errors only (their
    warnings are rank 0's too: shared train.log and console hold each once)."""
    root = logging.getLogger("tessera")
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(logging.INFO)
    root.propagate = False
    level = logging.INFO if (all_ranks or speaks(rank)) else logging.ERROR
    fmt = logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S")
    rank_filter = _RankFilter(rank, world)
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(level)
    console.setFormatter(fmt)
    console.addFilter(rank_filter)
    root.addHandler(console)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_file, mode="a")
        fh.setLevel(level)
        fh.setFormatter(fmt)
        fh.addFilter(rank_filter)
        root.addHandler(fh)


def get_logger(name: str = "tessera") -> logging.Logger:
    return logging.getLogger(name if name.startswith("tessera") else f"tessera.{name}")
