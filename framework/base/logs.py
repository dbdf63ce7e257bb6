"""Rank-aware logging under the `tessera` logger: rank 0 logs INFO (console and the run's train.log), the other
ranks warnings only. Every layer logs through `get_logger`; the trainer calls `setup_logging` once per run."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOG_FORMAT = "%(asctime)s [%(levelname)s] %(rankprefix)s%(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}/{world}] " if world > 1 else ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rankprefix = self.prefix
        return True


def setup_logging(rank: int = 0, world: int = 1, log_file: Path | None = None, all_ranks: bool = False) -> None:
    """Rank-aware logging: rank 0 logs INFO to the console (and the file); other ranks log warnings only."""
    root = logging.getLogger("tessera")
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(logging.INFO)
    root.propagate = False
    level = logging.INFO if (rank == 0 or all_ranks) else logging.WARNING
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
