"""Sniff tests: micro-benchmarks every rank runs at once, each rank compared with its peers, the slowest named.

    report = sniff(device)     # every rank; the same report on every rank

- GEMM: a square matmul in the training dtype, per device (TFLOP/s);
- all-reduce over the whole world, and P2P to the rank `stride` on (a ring of send/recv): per-rank time from
  the issue to the completion seen by that rank; a slow link or NIC makes its own rank's time the outlier only for
  P2P, the collective's time is shared, so it is reported but scored as a world figure;
- all-to-all over the world, like all-reduce.
Per-rank times are all-gathered and scored with the straggler detector's robust z-score (framework/observe/
straggler.py): a rank whose GEMM or P2P time is an outlier is named with its figure and the median's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from framework.observe.straggler import robust_outliers

TESTS = ("gemm", "p2p", "all_reduce", "all_to_all")


@dataclass
class SniffReport:
    times: list[list[float]]
    """times[rank][test] in seconds, tests in TESTS order."""
    slow: list[dict[str, Any]] = field(default_factory=list)
    """Named outliers, the largest slowdown first: rank, test, seconds, median seconds, slowdown."""

    def lines(self) -> list[str]:
        med = [sorted(col)[len(col) // 2] for col in zip(*self.times, strict=True)]
        out = [f"{name}: median {m * 1e3:.2f} ms per call" for name, m in zip(TESTS, med, strict=True)]
        out += [f"rank {s['rank']} is slow in {s['test']}: {s['seconds'] * 1e3:.2f} ms against a median of "
                f"{s['median'] * 1e3:.2f} ms ({s['slowdown']:.2f}x)" for s in self.slow]
        return out


def _timed(fn: Any, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # Every rank starts the timed calls together: otherwise a rank slow in the test before (a throttled GEMM) makes
    # its P2P peers wait for it, and their P2P time carries its slowness.
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeats


def sniff(device: torch.device, *, gemm_n: int = 256, comm_numel: int = 1 << 16, repeats: int = 5, stride: int = 1,
          dtype: torch.dtype = torch.float32, threshold: float = 6.0, min_ratio: float = 1.3,
          slow_gemm_s: float = 0.0) -> SniffReport:
    """Run the sniff tests on every rank of the default group (module docstring).

    Args:
        slow_gemm_s: fault injection for tests and drills: sleep this long in each GEMM call of this rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.randn(gemm_n, gemm_n, device=device, dtype=dtype)
    buf = torch.ones(comm_numel, device=device)
    recv = torch.empty_like(buf)
    chunks = torch.ones(world * max(1, comm_numel // world), device=device)
    out = torch.empty_like(chunks)

    def gemm() -> None:
        a @ a
        if slow_gemm_s:
            time.sleep(slow_gemm_s)

    def p2p() -> None:
        ops = [dist.P2POp(dist.isend, buf, (rank + stride) % world),
               dist.P2POp(dist.irecv, recv, (rank - stride) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    mine = [_timed(gemm, repeats, device), _timed(p2p, repeats, device),
            _timed(lambda: dist.all_reduce(buf), repeats, device),
            _timed(lambda: dist.all_to_all_single(out, chunks), repeats, device)]
    gathered = torch.zeros(world * len(TESTS), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(gathered, torch.tensor(mine, dtype=torch.float64, device=device))
    times = gathered.view(world, len(TESTS)).cpu().tolist()
    report = SniffReport(times)
    per_rank = [row[:2] for row in times]  # gemm, p2p: a rank's own figure; collectives are shared by all
    for o in robust_outliers(per_rank, threshold, min_ratio, names=TESTS[:2], floor_s=1e-6):
        col = TESTS.index(o.section)
        median = sorted(row[col] for row in times)[world // 2]
        report.slow.append({"rank": o.who, "test": TESTS[col], "seconds": times[o.who][col], "median": median,
                            "slowdown": o.slowdown})
    report.slow.sort(key=lambda s: -s["slowdown"])  # the slowest first
    return report
