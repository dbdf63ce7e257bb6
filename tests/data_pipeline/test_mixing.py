"""Mixture order: prefix accuracy (against megatron-core's BlendedDataset assignment), schedules, caps."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.read.mixing import MixtureSamples, mixture_order
from framework.base.errors import DataError


def _prefix_error(src: np.ndarray, w: np.ndarray) -> float:
    n = len(src)
    counts = np.zeros((n, len(w)))
    counts[np.arange(n), src] = 1
    return float(np.abs(counts.cumsum(0) - np.outer(np.arange(1, n + 1), w / w.sum())).max())


def _megatron_order(w: np.ndarray, n: int) -> np.ndarray:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers_cpp  # the C++ helper BlendedDataset uses

    idx, sample = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    helpers_cpp.build_blending_indices(idx, sample, (w / w.sum()).astype(np.float64), len(w), n, False)
    return idx


def test_realized_proportions_track_weights_at_every_prefix() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        k = int(rng.integers(2, 7))
        w = rng.random(k)
        w[rng.random(k) < 0.2] *= 0.01  # some tiny weights
        n = 20_000
        src, ordinal = mixture_order(w, n)
        err = _prefix_error(src, w)
        # Within ~1 sample of w_i * N after every N; megatron-core's greedy assignment is the yardstick.
        assert err <= 1.5, (w, err)
        assert err <= _prefix_error(_megatron_order(w, n), w) + 1.0
        for i in range(k):  # each source's samples are drawn in order 0, 1, 2, ...
            assert np.array_equal(ordinal[src == i], np.arange((src == i).sum()))


def test_zero_weight_is_never_drawn_and_order_depends_only_on_weights() -> None:
    src, _ = mixture_order([0.5, 0.0, 0.5], 1000)
    assert 1 not in set(src.tolist())
    a, _ = mixture_order([1, 2, 3], 5000)
    b, _ = mixture_order([2, 4, 6], 5000)  # same normalized weights
    assert np.array_equal(a, b)
    assert np.array_equal(mixture_order([1, 2, 3], 100)[0], a[:100])  # prefixes agree whatever the length


class _Src:
    """A source whose sample k encodes (source id, k)."""

    def __init__(self, ident: int, n: int) -> None:
        self.ident, self.n = ident, n

    def __len__(self) -> int:
        return self.n

    def sample(self, k: int) -> np.ndarray:
        return np.array([self.ident, k], dtype=np.int64)


def test_schedule_carries_source_cursors_over_phases() -> None:
    sources = {"a": _Src(0, 1000), "b": _Src(1, 1000)}
    mix = MixtureSamples(sources, [(0, {"a": 0.5, "b": 0.5}), (100, {"a": 0.0, "b": 1.0})], length=300)
    drawn = np.array([mix[j] for j in range(300)])
    first, second = drawn[:100], drawn[100:]
    assert (first[:, 0] == 0).sum() == 50 and (second[:, 0] == 1).all()
    b_ordinals = drawn[drawn[:, 0] == 1, 1]
    assert np.array_equal(b_ordinals, np.arange(len(b_ordinals)))  # no sample of b repeated at the boundary
    assert mix.draws == {"a": 50, "b": 250}
    # Pure function of the index: wrap-around repeats the pass, a fresh object agrees.
    again = MixtureSamples(sources, [(0, {"a": 0.5, "b": 0.5}), (100, {"a": 0.0, "b": 1.0})], length=300)
    assert np.array_equal(again[257], drawn[257]) and np.array_equal(mix[300 + 7], drawn[7])


def test_epoch_cap_and_unknown_source_are_errors() -> None:
    sources = {"big": _Src(0, 1000), "small": _Src(1, 10)}
    with pytest.raises(DataError, match=r"'small' would be read 5.00 times \(its epoch cap is 2"):
        MixtureSamples(sources, [(0, {"big": 0.5, "small": 0.5})], length=100, max_epochs={"small": 2})
    mix = MixtureSamples(sources, [(0, {"big": 0.5, "small": 0.5})], length=100, max_epochs={"small": 5})
    assert mix.epochs_used()["small"] == pytest.approx(5.0)  # upsampled 5x, within its cap
    with pytest.raises(DataError, match="known sources"):
        MixtureSamples(sources, [(0, {"huge": 1.0})], length=100)


def test_an_appended_phase_keeps_every_earlier_sample_and_draws_its_weights() -> None:
    sources = {"a": _Src(0, 500), "b": _Src(1, 300), "c": _Src(2, 200)}
    base = MixtureSamples(sources, [(0, {"a": 0.5, "b": 0.3, "c": 0.2})], length=2000)
    first = base.with_phases([(400, {"a": 0.1, "b": 0.1, "c": 0.8})])
    both = first.with_phases([(1000, {"a": 0.6, "b": 0.2, "c": 0.2})])
    at_once = base.with_phases([(400, {"a": 0.1, "b": 0.1, "c": 0.8}), (1000, {"a": 0.6, "b": 0.2, "c": 0.2})])
    rows = {name: np.stack([m[j] for j in range(2000)]) for name, m in
            (("base", base), ("first", first), ("both", both), ("at_once", at_once))}
    assert np.array_equal(rows["first"][:400], rows["base"][:400])
    assert np.array_equal(rows["both"][:1000], rows["first"][:1000])
    assert np.array_equal(rows["both"], rows["at_once"])  # a resume rebuilds the list at once
    counts = np.bincount(rows["both"][400:1000, 0], minlength=3)
    assert np.abs(counts - 600 * np.array([0.1, 0.1, 0.8])).max() <= 1.5, counts
    for s in range(3):  # each source continues where it stopped: no sample repeats within its epoch
        drawn = rows["both"][rows["both"][:, 0] == s, 1]
        assert np.array_equal(drawn, np.arange(len(drawn)))
    with pytest.raises(DataError, match="must start after the last one"):
        first.with_phases([(400, {"a": 1.0})])
