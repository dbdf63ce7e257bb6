"""The robust outlier score of the straggler detector, on rank x section tables shaped like real step timings."""

from __future__ import annotations

import random

import torch

from framework.observe.config import StragglerConfig
from framework.observe.straggler import SECTIONS, StragglerDetector, robust_outliers


def _healthy(n: int, rng: random.Random) -> list[list[float]]:
    """Per-rank means of a 10-step window: ~3% jitter around data 2 ms, fwd 40 ms, bwd 80 ms, opt 10 ms, comm 5 ms."""
    base = (0.002, 0.040, 0.080, 0.010, 0.005)
    return [[b * rng.gauss(1.0, 0.03) for b in base] for _ in range(n)]


def test_one_slow_rank_among_1024_is_named_with_its_section_and_slowdown() -> None:
    times = _healthy(1024, random.Random(0))
    times[517][2] *= 1.5  # a throttled GPU: backward 1.5x
    (o,) = robust_outliers(times, threshold=6.0, min_ratio=1.3)
    assert (o.who, o.section) == (517, "backward") and 1.4 < o.slowdown < 1.6 and o.score > 6


def test_healthy_tables_raise_nothing_and_two_rows_decide_nothing() -> None:
    rng = random.Random(1)
    assert all(robust_outliers(_healthy(n, rng), 6.0, 1.3) == [] for n in (3, 8, 64, 1024) for _ in range(20))
    assert robust_outliers([[1.0] * 5, [9.0] * 5], 6.0, 1.3) == []


def test_a_flag_is_named_only_after_persist_windows_and_a_gap_resets_it() -> None:
    det = StragglerDetector(StragglerConfig(persist=3), rank=0, world=8, device=torch.device("cpu"))
    slow = _healthy(8, random.Random(2))
    slow[3][1] *= 3.0
    healthy = _healthy(8, random.Random(3))
    assert "straggler/rank" not in det.judge(slow, 10) | det.judge(slow, 20)
    assert "straggler/rank" not in det.judge(healthy, 30)  # the streak breaks
    assert "straggler/rank" not in det.judge(slow, 40) | det.judge(slow, 50)
    named = det.judge(slow, 60)
    assert (named["straggler/rank"], named["straggler/section"], named["straggler/windows"]) == (3, "forward", 3)
    assert SECTIONS[1] == "forward" and 2.5 < named["straggler/slowdown"] < 3.5
