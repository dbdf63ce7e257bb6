"""Straggler detection: per-rank step sections, gathered every N steps, scored against the peers.

Every rank times the sections of each step (data wait, forward, backward, optimizer, and the collectives'
exposed time when `parallel.comm_log` measures it) and keeps a sum. Every `observe.straggler.interval` steps
the per-rank means are all-gathered (one small collective) and every rank scores them the same way:

    score = (x - median) / (1.4826 * MAD)        per section, over the ranks (and over the hosts' means)

a robust z-score (Hampel 1974), so one slow rank cannot hide itself by inflating the spread it is judged by.
A rank is flagged in a window when its score passes `threshold` AND it is `min_ratio` times the median (a
floor that keeps near-identical ranks with a tiny MAD quiet). A flag held for `persist` windows in a row by the
same (rank, section) is a persistent straggler: named in the log (rank 0) and in the train record as
`straggler/*` (host, rank, section, slowdown). Every rank computes the same verdict from the same gathered
matrix, so no further agreement is needed. A slow rank makes its peers wait in the next collective: their
waiting shows in a later section of every peer, a majority, which the median absorbs.

Fault injection for tests and drills: `observe.straggler.inject="RANK:SECTION:SECONDS"` sleeps in that section of
that rank every step (forward, backward or optimizer).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.base.logs import get_logger
from framework.observe.config import StragglerConfig

log = get_logger("straggler")

SECTIONS = ("data", "forward", "backward", "optimizer", "comm")
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x 1.4826 = its standard deviation


@dataclass(frozen=True)
class Outlier:
    who: int
    """Rank (or host index) that is slow."""
    section: str
    score: float
    slowdown: float
    """Its time over the median of its peers."""


def robust_outliers(times: list[list[float]], threshold: float, min_ratio: float, names: tuple[str, ...] = SECTIONS,
                    floor_s: float = 1e-3) -> list[Outlier]:
    """Rows (ranks or hosts) whose section time is a high outlier among the rows, worst first.

    Args:
        times: times[row][section] in seconds, sections in `names` order.
        threshold: robust z-score above which a row is an outlier.
        min_ratio: and its time must be at least this multiple of the median.
        floor_s: the MAD is floored at this many seconds (identical rows have MAD 0): a difference under a
            millisecond is not worth naming.
    """
    out: list[Outlier] = []
    if len(times) < 3:  # two rows cannot say which one is slow
        return out
    t = torch.tensor(times, dtype=torch.float64)
    median = t.median(dim=0).values
    mad = (t - median).abs().median(dim=0).values
    scale = torch.clamp(MAD_TO_SIGMA * mad, min=floor_s)
    score = (t - median) / scale
    for row in range(t.shape[0]):
        for col, name in enumerate(names):
            ratio = float(t[row, col] / median[col]) if median[col] > 0 else float("inf")
            if score[row, col] > threshold and ratio >= min_ratio and t[row, col] > floor_s:
                out.append(Outlier(row, name, float(score[row, col]), ratio))
    return sorted(out, key=lambda o: -o.score)


class StragglerDetector:
    """Section timer and detector of one rank (see module docstring)."""

    def __init__(self, cfg: StragglerConfig, rank: int, world: int, device: torch.device) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.sums = [0.0] * len(SECTIONS)
        self.steps = 0
        self._fwd_start = 0.0
        self._fwd = 0.0
        self.streak: dict[tuple[str, int, str], int] = {}
        self.hosts: list[str] = [socket.gethostname()] * world
        self.named: dict[str, Any] = {}
        inject_rank, self._sleep_in, self._sleep = cfg.parse_inject() or (-1, "", 0.0)
        if inject_rank != rank:
            self._sleep_in, self._sleep = "", 0.0

    def gathered_hosts(self) -> list[str]:
        """Every rank's hostname (gathered by `attach` when the detector is active, else now: a collective)."""
        if not self.active and dist.is_initialized():
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, socket.gethostname())
            self.hosts = [str(h) for h in gathered]
        return self.hosts

    @property
    def active(self) -> bool:
        return self.cfg.enabled and self.world > 1

    def attach(self, parts: list[nn.Module], optimizers: list[Any]) -> None:
        """Time forward with hooks on the model parts; add the injected fault, if any, to its section."""
        if not self.active:
            return
        if dist.is_initialized():
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, socket.gethostname())
            self.hosts = [str(h) for h in gathered]
        for part in parts:
            part.register_forward_pre_hook(self._pre_forward)
            part.register_forward_hook(self._post_forward)
        if self._sleep_in == "optimizer":
            for opt in optimizers:
                opt.register_step_pre_hook(lambda *_: time.sleep(self._sleep))

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._fwd_start = time.perf_counter()
        if self._sleep_in == "forward":
            time.sleep(self._sleep)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._fwd += time.perf_counter() - self._fwd_start
        if self._sleep_in == "backward" and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: time.sleep(self._sleep) or g)  # type: ignore[func-returns-value]

    def on_step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Add this step's sections; on every interval-th step gather, score, and name a persistent straggler."""
        if not self.active:
            return {}
        forward = min(self._fwd, float(record["fwd_bwd_time_s"]))
        self._fwd = 0.0
        comm = float(record.get("comm/exposed_s", 0.0))
        sections = (record["data_time_s"], forward, record["fwd_bwd_time_s"] - forward, record["optim_time_s"], comm)
        self.sums = [s + float(x) for s, x in zip(self.sums, sections, strict=True)]
        self.steps += 1
        if record["step"] % self.cfg.interval:
            return {}
        mine = torch.tensor([s / max(self.steps, 1) for s in self.sums], dtype=torch.float64)
        self.sums, self.steps = [0.0] * len(SECTIONS), 0
        out = torch.zeros(self.world * len(SECTIONS), dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(out, mine.to(self.device))
        return self.judge(out.view(self.world, len(SECTIONS)).cpu().tolist(), int(record["step"]))

    def judge(self, times: list[list[float]], step: int) -> dict[str, Any]:
        """The verdict of one window (the same on every rank): the straggler/* fields of the train record."""
        host_names = sorted(set(self.hosts))
        per_host = [[sum(col) / len(col) for col in zip(*(times[r] for r in range(self.world)
                                                           if self.hosts[r] == h), strict=True)]
                    for h in host_names]
        found = {("rank", o.who, o.section): o for o in robust_outliers(times, self.cfg.threshold, self.cfg.min_ratio)}
        found |= {("host", o.who, o.section): o
                  for o in robust_outliers(per_host, self.cfg.threshold, self.cfg.min_ratio)}
        self.streak = {key: self.streak.get(key, 0) + 1 for key in found}
        out: dict[str, Any] = {"straggler/max_score": max((o.score for o in found.values()), default=0.0)}
        held = [(key, n) for key, n in self.streak.items() if n >= self.cfg.persist]
        if not held:
            return out
        (kind, who, section), windows = max(held, key=lambda kn: found[kn[0]].score)
        o = found[(kind, who, section)]
        host = host_names[who] if kind == "host" else self.hosts[who]
        out.update({"straggler/kind": kind, "straggler/host": host, "straggler/rank": who if kind == "rank" else -1,
                    "straggler/section": section, "straggler/slowdown": o.slowdown, "straggler/score": o.score,
                    "straggler/windows": windows})
        if self.rank == 0:
            log.warning("straggler: %s %s (host %s) is %.2fx the median in section %s (robust z %.1f) for %d "
                        "windows of %d steps, up to step %d", kind, who if kind == "rank" else host, host,
                        o.slowdown, section, o.score, windows, self.cfg.interval, step)
        self.named = out
        return out
