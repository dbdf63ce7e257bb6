"""Load-robust A/B timing on a shared CPU machine: per-thread CPU time, strictly interleaved rounds, paired ratios.

On a machine shared by several jobs (load 10-50 on 2 cores) wall-clock time mostly measures the scheduler: a
call that is descheduled for 200 ms reads 200 ms slower. Per-thread CPU time (`time.thread_time`, i.e.
CLOCK_THREAD_CPUTIME_ID) counts only the time this thread ran, so it is what to compare, as long as all the work
runs on the calling thread: `torch.set_num_threads(1)` (ops run inline, no OpenMP pool) and CPU autograd runs the
backward on the caller's thread. What remains of load (caches and memory bandwidth shared with the other jobs,
SMT, frequency) drifts slowly, so the candidates run strictly interleaved, one call each per round in a shuffled
order, and each round gives one *paired* ratio A_i / B_i: drift common to a round cancels. The figure is the
median of the paired ratios with a bootstrap 95% interval over rounds; an A/A pair (two identical copies of the
same candidate) in the same rounds shows the method's own noise floor.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


def thread_cpu_s() -> float:
    """CPU seconds consumed by the calling thread (CLOCK_THREAD_CPUTIME_ID)."""
    return time.thread_time()


@dataclass(frozen=True)
class Samples:
    """Per-round costs of each candidate: `cpu[name][i]` thread CPU seconds, `wall[name][i]` wall seconds.

    `coverage`: the timed calls' thread CPU time over the process's CPU time across the same calls. Near 1 means
    the calling thread did all the work; well below it, other threads (an intra-op pool, a backward on a worker
    thread) worked unseen and the thread clock undercounts.
    """

    cpu: dict[str, list[float]]
    wall: dict[str, list[float]]
    coverage: float


def interleaved(fns: dict[str, Callable[[], None]], rounds: int, warmup: int = 3, seed: int = 0,
                before: Callable[[], None] | None = None) -> Samples:
    """Run every fn once per round, in a fresh random order each round, timing each call on its own.

    `before` runs untimed ahead of every call (e.g. dropping .grad so no call pays for accumulating another's).
    The garbage collector is off during the rounds so no candidate pays for another's garbage.
    """
    rng = random.Random(seed)
    names = list(fns)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(warmup):
        for n in names:
            if before is not None:
                before()
            fns[n]()
    gc.collect()
    gc.disable()
    timed_process = 0.0
    try:
        for _ in range(rounds):
            rng.shuffle(names)
            for n in names:
                if before is not None:
                    before()
                w0, p0, c0 = time.perf_counter(), time.process_time(), thread_cpu_s()
                fns[n]()
                c1, p1, w1 = thread_cpu_s(), time.process_time(), time.perf_counter()
                timed_process += p1 - p0
                cpu[n].append(c1 - c0)
                wall[n].append(w1 - w0)
    finally:
        gc.enable()
    return Samples(cpu, wall, sum(map(sum, cpu.values())) / timed_process)


@dataclass(frozen=True)
class Ratio:
    """Median of the paired per-round ratios a_i / b_i and its bootstrap 95% interval."""

    median: float
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.lo:.3f}, {self.hi:.3f}]"

    def verdict(self, a: str, b: str) -> str:
        """`a` faster, slower, or not measurably different from `b`, by whether the interval excludes 1."""
        if self.hi < 1:
            return f"{a} is faster than {b} ({self})"
        if self.lo > 1:
            return f"{a} is slower than {b} ({self})"
        return f"{a} and {b} do not differ measurably ({self}: the interval holds 1)"


def paired_ratio(a: list[float], b: list[float], n_boot: int = 2000, seed: int = 0) -> Ratio:
    """Median of a_i / b_i over rounds, with a percentile bootstrap (resampling rounds) 95% interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs two equally long, non-empty sample lists, got {len(a)} and {len(b)}")
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    rng = random.Random(seed)
    n = len(ratios)
    boots = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(n_boot))
    return Ratio(statistics.median(ratios), boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1])


def iqr_rel(xs: list[float]) -> float:
    """Interquartile range / median: the spread of one candidate's per-call costs."""
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def loadavg() -> str:
    """The 1-minute load average (the machine's load during a run), or '?' where /proc is missing."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"
