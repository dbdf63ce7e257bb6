"""BatchLoader slicing, resume and errors; SyntheticSamples determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_pipeline.read.loader import BatchLoader, SyntheticSamples
from framework.base.errors import ConfigError


class _Indexed:
    """Samples whose tokens encode their own global index (so slices can be checked exactly)."""

    def __init__(self, n: int, seq_len: int = 3) -> None:
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.seq_len + 1, i, dtype=np.int64)


def test_ranks_take_contiguous_slices_and_together_equal_one_rank() -> None:
    samples = _Indexed(1000)
    G, steps = 16, 5
    reference = BatchLoader(samples, global_batch_size=G, micro_batch_size=2, dp_rank=0, dp_size=1)
    ref = [reference.next_batch().reshape(-1, 4)[:, 0] for _ in range(steps)]
    for b in range(steps):
        assert ref[b].tolist() == list(range(b * G, (b + 1) * G))
    for dp in (2, 4):
        loaders = [BatchLoader(samples, global_batch_size=G, micro_batch_size=2, dp_rank=r, dp_size=dp)
                   for r in range(dp)]
        for b in range(steps):
            parts = [ld.next_batch() for ld in loaders]
            assert parts[0].shape == (G // (2 * dp), 2, 4) and parts[0].dtype == torch.int64
            got = torch.cat([p.reshape(-1, 4)[:, 0] for p in parts])
            assert torch.equal(got, ref[b])
            assert all(ld.consumed_samples == (b + 1) * G for ld in loaders)


def test_restored_loader_yields_what_an_uninterrupted_one_would() -> None:
    samples = SyntheticSamples(vocab_size=97, seq_len=8, seed=3, length=50)  # small: exercises wrap-around
    straight = BatchLoader(samples, global_batch_size=12, micro_batch_size=3, dp_rank=1, dp_size=2)
    expected = [straight.next_batch() for _ in range(10)]
    first = BatchLoader(samples, global_batch_size=12, micro_batch_size=3, dp_rank=1, dp_size=2)
    for _ in range(4):
        first.next_batch()
    state = first.state_dict()
    assert state == {"consumed_samples": 48}
    resumed = BatchLoader(samples, global_batch_size=12, micro_batch_size=3, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    for b in range(4, 10):
        assert torch.equal(resumed.next_batch(), expected[b])


def test_wraps_around_the_sample_sequence() -> None:
    loader = BatchLoader(_Indexed(10), global_batch_size=4, micro_batch_size=4, dp_rank=0, dp_size=1)
    seen = [loader.next_batch()[0, :, 0].tolist() for _ in range(3)]
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_global_batch_not_divisible_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"global_batch_size=10 .*micro_batch_size x data-parallel size = 2 x 2"):
        BatchLoader(_Indexed(10), global_batch_size=10, micro_batch_size=2, dp_rank=0, dp_size=2)
    with pytest.raises(ConfigError, match="dp_rank"):
        BatchLoader(_Indexed(10), global_batch_size=4, micro_batch_size=2, dp_rank=2, dp_size=2)


def test_synthetic_samples_are_deterministic_per_index() -> None:
    a = SyntheticSamples(vocab_size=50, seq_len=16, seed=7)
    b = SyntheticSamples(vocab_size=50, seq_len=16, seed=7)
    c = SyntheticSamples(vocab_size=50, seq_len=16, seed=8)
    s = a[123]
    assert s.dtype == np.int64 and s.shape == (17,) and 0 <= s.min() and s.max() < 50
    assert np.array_equal(s, b[123]) and not np.array_equal(s, a[124]) and not np.array_equal(s, c[123])
    with pytest.raises(ConfigError, match="vocab_size"):
        SyntheticSamples(vocab_size=1, seq_len=4, seed=0)
