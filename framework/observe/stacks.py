"""Reading the hang watchdog's stack dumps (`stacks/rank_R.txt`, framework/checkpoint/watchdog.py).

Each dump is a header line (rank, idle time, last completed step) and `faulthandler`'s per-thread stacks, most
recent call first. The thread that matters is the main one (the training loop): the watchdog's own thread is
the "Current thread". A rank whose main thread sits inside torch.distributed waits for its peers; a rank that
is not in a collective — or finished fewer steps — is the one behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_HEADER = re.compile(r"rank (\d+) pid (\d+): no step completed for ([\d.]+) s .*last completed step (\w+)")
_FRAME = re.compile(r'\s*File "(.+)", line (\d+) in (.+)')
_P2P = ("irecv", "isend", "recv", "send", "batch_isend_irecv", "_batch_p2p", "_sorted_batch_p2p")


@dataclass
class RankStack:
    rank: int
    last_step: int | None
    idle_s: float
    frames: list[tuple[str, int, str]] = field(default_factory=list)
    """The main thread's frames (file, line, function), innermost first."""

    @property
    def collective(self) -> str | None:
        """The torch.distributed call this rank waits in ("all_reduce", "pipeline send/recv", ...), or None."""
        for path, _, func in self.frames[:12]:
            if "torch/distributed/pipelining" in path:
                return f"pipeline send/recv ({Path(path).name}:{func})"
            if "torch/distributed/" in path and (path.endswith("distributed_c10d.py") or func in _P2P):
                return func
        return None

    @property
    def where(self) -> str:
        """The innermost frame in the project's own code (not the standard library or site-packages)."""
        for path, line, func in self.frames:
            if "site-packages" not in path and "/lib/python" not in path:
                return f"{func} ({path}:{line})"
        return f"{self.frames[0][2]} ({self.frames[0][0]}:{self.frames[0][1]})" if self.frames else "?"


def _threads(text: str) -> list[tuple[bool, list[tuple[str, int, str]]]]:
    out: list[tuple[bool, list[tuple[str, int, str]]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            out.append((line.startswith("Current"), []))
        elif out and (m := _FRAME.match(line)):
            out[-1][1].append((m.group(1), int(m.group(2)), m.group(3)))
    return out


def parse_dump(path: Path) -> RankStack | None:
    text = path.read_text(errors="replace")
    m = _HEADER.search(text)
    if m is None:
        return None
    threads = [frames for current, frames in _threads(text) if not current and frames]
    # The main thread is the one whose outermost frame is a module (`<module>`); else the deepest stack.
    main = next((f for f in threads if f[-1][2] == "<module>"), max(threads, key=len, default=[]))
    step = int(m.group(4)) if m.group(4).isdigit() else None
    return RankStack(int(m.group(1)), step, float(m.group(3)), main)


def read_dumps(run_dir: Path) -> list[RankStack]:
    out = [s for p in sorted((run_dir / "stacks").glob("rank_*.txt")) if (s := parse_dump(p)) is not None]
    return sorted(out, key=lambda s: s.rank)


def behind(stacks: list[RankStack]) -> list[RankStack]:
    """The ranks holding the others up: not in a collective, else those with the fewest completed steps."""
    outside = [s for s in stacks if s.collective is None]
    if outside and len(outside) < len(stacks):
        return outside
    steps = [s.last_step for s in stacks if s.last_step is not None]
    if steps and min(steps) < max(steps):
        return [s for s in stacks if s.last_step == min(steps)]
    return outside
