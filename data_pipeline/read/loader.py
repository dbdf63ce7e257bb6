"""The trainer's view of data: a global sequence of packed samples and a data-parallel batch loader.

Batch b covers global sample indices [b*G, (b+1)*G) (G = global batch size); data-parallel rank r takes the
contiguous slice [r*G/dp, (r+1)*G/dp) and splits it into micro-batches in order. The loader's whole state is
`consumed_samples` and the quarantine, so a restored loader yields exactly what an uninterrupted one would, at any
world size.

Quarantine: global sample indices the spike triage found to cause a loss spike (framework/train/triage.py). The
loader's positions count the samples it hands out, so position p reads the p-th sample index not quarantined: a
quarantined sample is skipped on this and every later start, and the run reads what a run whose data never held
it would read from that point on. The list travels in the loader state (the checkpoint's meta.json).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from framework.base.errors import ConfigError, DataError


@runtime_checkable
class Samples(Protocol):
    """A global, deterministic sequence of packed samples (int64, length seq_len + 1)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


class SyntheticSamples:
    """Seeded random tokens, for engine tests and benchmarks; sample i depends only on (seed, i).

    Args:
        vocab_size: Tokens are drawn uniformly from [0, vocab_size).
        seq_len: Each sample holds seq_len + 1 tokens.
        seed: Seed of the whole sequence.
        length: Number of samples (indices wrap around it).
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, length: int = 1 << 30) -> None:
        if vocab_size < 2 or seq_len < 1 or length < 1:
            raise ConfigError(f"SyntheticSamples(vocab_size={vocab_size}, seq_len={seq_len}, length={length}): "
                              f"need vocab_size >= 2, seq_len >= 1 and length >= 1")
        self.vocab_size, self.seq_len, self.seed, self.length = vocab_size, seq_len, seed, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, int(i) % self.length])
        return rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)


class BatchLoader:
    """Hands each data-parallel rank its slice of every global batch, as micro-batches.

    Args:
        samples: The global sample sequence (wrapped modulo its length, as epochs).
        global_batch_size: Sequences per optimizer step over all ranks (G).
        micro_batch_size: Sequences per forward pass on one rank.
        dp_rank: This rank's data-parallel index.
        dp_size: Number of data-parallel ranks.
        consumed_samples: Global samples already consumed (the resume point).
    """

    def __init__(self, samples: Samples, *, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0) -> None:
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"BatchLoader: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                              f"dp_size={dp_size}: need micro >= 1, dp_size >= 1 and 0 <= dp_rank < dp_size")
        per_step = micro_batch_size * dp_size
        if global_batch_size < 1 or global_batch_size % per_step:
            fix = max(1, round(global_batch_size / per_step)) * per_step
            raise ConfigError(
                f"train.global_batch_size={global_batch_size} must be a multiple of train.micro_batch_size x "
                f"data-parallel size = {micro_batch_size} x {dp_size} = {per_step}; set it to e.g. {fix}")
        if len(samples) < 1:
            raise DataError("the sample sequence is empty; the data holds no full sample of seq_len + 1 tokens — "
                            "lower data.seq_len or add data")
        self.samples = samples
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.n_micro = global_batch_size // per_step
        self.consumed_samples = consumed_samples
        self.quarantine = np.zeros(0, dtype=np.int64)
        """Sorted global sample indices never handed out (module docstring)."""

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Sample index of each loader position: the position-th index not in the quarantine (modulo the length)."""
        out = positions.astype(np.int64)
        for _ in range(len(self.quarantine) + 1):  # i = p + #{q <= i} climbs to its least fixed point
            step = positions + np.searchsorted(self.quarantine, out, side="right")
            if np.array_equal(step, out):
                break
            out = step
        return out % len(self.samples)

    def rank_indices(self, consumed_samples: int | None = None) -> np.ndarray:
        """Global sample indices of this rank's next batch, shaped (n_micro, micro_batch_size)."""
        start = self.consumed_samples if consumed_samples is None else consumed_samples
        per_rank = self.global_batch_size // self.dp_size
        first = start + self.dp_rank * per_rank
        idx = self.indices_at(np.arange(first, first + per_rank, dtype=np.int64))
        return idx.reshape(self.n_micro, self.micro_batch_size)

    def quarantine_batch(self, start: int) -> list[int]:
        """Quarantine the global batch read from position `start` (the last one) and step back onto its position,
        which now reads the next samples. Returns the quarantined indices."""
        idx = self.indices_at(np.arange(start, start + self.global_batch_size, dtype=np.int64))
        self.quarantine = np.union1d(self.quarantine, idx)
        self.consumed_samples = start
        return [int(i) for i in idx]

    def next_batch(self) -> torch.Tensor:
        """This rank's micro-batches of the next global batch: (n_micro, micro_batch_size, seq_len + 1) int64."""
        batch = self.batch_at(self.consumed_samples)
        self.consumed_samples += self.global_batch_size
        return batch

    def batch_at(self, consumed_samples: int) -> torch.Tensor:
        """The batch `next_batch` returns when `consumed_samples` global samples were consumed; no state changes
        (a prefetching thread reads ahead with it)."""
        idx = self.rank_indices(consumed_samples)
        rows = [np.asarray(self.samples[int(i)], dtype=np.int64) for i in idx.reshape(-1)]
        return torch.from_numpy(np.stack(rows)).view(self.n_micro, self.micro_batch_size, -1)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"consumed_samples": self.consumed_samples}
        if len(self.quarantine):
            out["quarantine"] = [int(i) for i in self.quarantine]
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Take the position; add the state's quarantine to this loader's (a rollback to a checkpoint older than a
        quarantine keeps it)."""
        if "consumed_samples" not in sd:
            raise DataError(f"loader state {sd!r} lacks 'consumed_samples'; it is not a BatchLoader state_dict")
        self.consumed_samples = int(sd["consumed_samples"])
        self.quarantine = np.union1d(self.quarantine, np.asarray(sd.get("quarantine", []), dtype=np.int64))


__all__ = ["BatchLoader", "Samples", "SyntheticSamples"]
