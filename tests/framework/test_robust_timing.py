"""bench/robust_timing.py: the paired-ratio statistics and the thread clock the benches' figures rest on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.robust_timing import interleaved, paired_ratio


def test_paired_ratio_cancels_drift_common_to_a_round() -> None:
    # b costs twice a's in every round, while the machine slows both by up to 10x from round to round.
    drift = [1.0 + 9.0 * ((i * 37) % 11) / 10 for i in range(60)]
    a, b = [d * 1.0 for d in drift], [d * 2.0 for d in drift]
    r = paired_ratio(a, b)
    assert r.median == pytest.approx(0.5) and r.lo == pytest.approx(0.5) and r.hi == pytest.approx(0.5)
    assert "faster" in r.verdict("a", "b") and "slower" in paired_ratio(b, a).verdict("b", "a")
    noisy = paired_ratio([1.0, 1.2, 0.9, 1.1, 1.0, 0.95], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert noisy.lo <= noisy.median <= noisy.hi and "do not differ measurably" in noisy.verdict("a", "b")
    with pytest.raises(ValueError, match="equally long"):
        paired_ratio([1.0], [1.0, 2.0])


def test_interleaved_times_every_candidate_each_round_on_the_calling_thread() -> None:
    torch.set_num_threads(1)
    x = torch.randn(128, 128, requires_grad=True)
    calls: list[str] = []

    def work(name: str, n: int) -> None:
        calls.append(name)
        for _ in range(n):
            (x @ x).sum().backward()

    res = interleaved({"one": lambda: work("one", 2), "three": lambda: work("three", 6)}, rounds=8, warmup=1,
                      before=lambda: setattr(x, "grad", None))
    assert calls.count("one") == calls.count("three") == 9 and len(res.cpu["one"]) == 8
    assert set(calls[2:4]) == {"one", "three"}  # one call of each per round
    assert res.coverage > 0.9, "the backward ran off the calling thread: its CPU clock would undercount"
    assert 1.5 < paired_ratio(res.cpu["three"], res.cpu["one"]).median < 6
