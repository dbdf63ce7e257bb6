"""Progress of a build's stages on stderr: a tqdm bar on a terminal, and plain timestamped lines otherwise (SLURM
logs, nohup), so a long stage is never silent; every stage ends with one summary line either way."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from framework.base.logs import speaks

LOG_EVERY_S = 30.0


def log(msg: str) -> None:
    """One line on stderr, flushed (logs read while the build runs); in a training job only rank 0's, as every
    rank prepares the same data (framework/base/logs.py decides which rank speaks)."""
    if speaks():
        print(f"[data {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Progress:
    """Counts units of a stage; `close(summary)` logs the summary with the stage's wall time.

    Args:
        desc: The stage and source, e.g. "ingest web".
        unit: What is counted (doc, shard).
        total: The number of units when known.
    """

    def __init__(self, desc: str, unit: str, total: int | None = None) -> None:
        self.desc, self.unit, self.total, self.n = desc, unit, total, 0
        self.t0 = self.last = time.monotonic()
        self.bar: Any = tqdm(desc=desc, unit=unit, total=total, disable=None)  # None: only on a terminal
        self.quiet_bar = self.bar.disable

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)
        now = time.monotonic()
        if self.quiet_bar and now - self.last >= LOG_EVERY_S:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            log(f"{self.desc}: {self.n:,}{of} {self.unit}s, {now - self.t0:.0f} s")

    def close(self, summary: str = "") -> None:
        self.bar.close()
        log(f"{self.desc}: {summary or f'{self.n:,} {self.unit}s'} in {time.monotonic() - self.t0:.1f} s")
