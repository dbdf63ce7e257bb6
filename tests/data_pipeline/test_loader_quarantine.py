"""The loader's quarantine: positions skip quarantined sample indices, the loader steps back onto the quarantined
batch's position (so the next batch is the samples that followed it), and the list survives a state round trip."""

from __future__ import annotations

import numpy as np

from data_pipeline.read.loader import BatchLoader, SyntheticSamples


def _loaders(consumed: int = 0) -> list[BatchLoader]:
    samples = SyntheticSamples(512, 8, seed=3, length=1000)
    return [BatchLoader(samples, global_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=4,
                        consumed_samples=consumed) for r in range(4)]


def _global(loaders: list[BatchLoader]) -> list[int]:
    return [int(i) for lo in loaders for i in lo.rank_indices().reshape(-1)]


def test_quarantining_the_last_batch_makes_the_next_batch_the_samples_after_it() -> None:
    loaders = _loaders(consumed=40)
    for lo in loaders:
        lo.next_batch()  # reads positions [40, 48): the poisoned batch
        assert lo.quarantine_batch(40) == list(range(40, 48))
    assert _global(loaders) == list(range(48, 56))  # not [56, 64): no clean batch is lost
    resumed = _loaders(consumed=32)
    for lo, old in zip(resumed, loaders, strict=True):
        lo.load_state_dict({"consumed_samples": 32})
        lo.load_state_dict(old.state_dict())  # the quarantine merges in
        lo.load_state_dict({"consumed_samples": 32, "quarantine": []})  # an older checkpoint never drops it
    assert _global(resumed) == list(range(32, 40))
    for lo in resumed:
        lo.next_batch()
    assert _global(resumed) == list(range(48, 56))


def test_positions_map_to_the_indices_not_quarantined_at_any_spread() -> None:
    lo = _loaders()[0]
    rng = np.random.default_rng(0)
    lo.quarantine = np.unique(rng.integers(0, 900, size=200))
    expected = [i for i in range(1000) if i not in set(lo.quarantine.tolist())]
    got = lo.indices_at(np.arange(len(expected)))
    assert got.tolist() == expected
