"""The prefetching loader hands out bitwise the batches of the plain loader, reads the next one on its thread before
it is asked for, and keeps the state of what it handed out (checkpoints and rollbacks see no read-ahead)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from data_pipeline.read.loader import BatchLoader, SyntheticSamples
from data_pipeline.read.prefetch import PrefetchingLoader


class _Watched:
    """Samples that note which thread read which index."""

    def __init__(self, inner: SyntheticSamples) -> None:
        self.inner = inner
        self.reads: list[tuple[int, int]] = []  # (index, thread id)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> np.ndarray:
        self.reads.append((i, threading.get_ident()))
        return self.inner[i]


def _loader(samples: object, dp_rank: int = 1) -> BatchLoader:
    return BatchLoader(samples, global_batch_size=12, micro_batch_size=2, dp_rank=dp_rank, dp_size=3)  # type: ignore[arg-type]


def test_same_batches_bitwise_through_a_rollback_and_a_resume() -> None:
    samples = SyntheticSamples(vocab_size=1000, seq_len=16, seed=3, length=50)  # wraps around within the run
    plain, ahead = _loader(samples), PrefetchingLoader(_loader(samples))
    try:
        for step in range(9):
            if step == 4:  # a rollback: back to an earlier position, skipping nothing
                for loader in (plain, ahead):
                    loader.load_state_dict({"consumed_samples": 12})
            if step == 7:  # a resume elsewhere
                for loader in (plain, ahead):
                    loader.load_state_dict({"consumed_samples": 300})
            want, got = plain.next_batch(), ahead.next_batch()
            assert got.dtype == want.dtype and torch.equal(got, want), step
            assert ahead.consumed_samples == plain.consumed_samples
            assert ahead.state_dict() == plain.state_dict()
    finally:
        ahead.close()


def test_next_batch_is_read_on_the_thread_before_it_is_asked_for() -> None:
    samples = _Watched(SyntheticSamples(vocab_size=1000, seq_len=16, seed=3))
    loader = PrefetchingLoader(_loader(samples, dp_rank=0))
    second = set(_loader(samples, dp_rank=0).rank_indices(12).reshape(-1).tolist())  # rows 12..15
    try:
        loader.next_batch()
        assert loader._ahead is not None
        loader._ahead[1].result(timeout=30)  # the read-ahead finishes while the step would run
        assert second <= {i for i, _ in samples.reads}
        assert threading.get_ident() not in {t for _, t in samples.reads}  # no row was read on the step's thread
        n = len(samples.reads)
        got = loader.next_batch()  # handed out from the read-ahead, not read again
        assert not second & {i for i, _ in samples.reads[n:]}
        assert torch.equal(got, _loader(samples, dp_rank=0).batch_at(12))
    finally:
        loader.close()
