"""Sequence packing: documents of one source concatenated (each ends with EOS) and cut into samples.

A sample holds `seq_len + 1` tokens (inputs and labels shifted by one). Consecutive samples overlap by one
token, like Megatron's GPTDataset, so every token is a label exactly once. Each epoch visits the documents in
its own seeded order and then the samples in their own seeded order; both permutations depend only on
(seed, source name, epoch), never on the world size or the number of loader workers.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from data_pipeline.indexed import IndexedTokens
from framework.base.errors import DataError


def stable_seed(*parts: object) -> int:
    """A 64-bit seed derived from `parts` (stable across processes, unlike `hash()`)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class PackedSource:
    """Packed samples of one source, epoch after epoch.

    Args:
        tokens: The source's indexed dataset (one sequence per document).
        doc_ids: Which documents take part (e.g. the training split), in build order.
        seq_len: Tokens per sample minus one.
        seed: Mixture seed; with `name` and the epoch it fixes the document and sample orders.
        name: Source name (part of the permutation seeds, so two sources never share an order).
        shuffle: False keeps build order (validation sets).
    """

    _CACHE_EPOCHS = 4

    def __init__(self, tokens: IndexedTokens, doc_ids: np.ndarray, *, seq_len: int, seed: int, name: str,
                 shuffle: bool = True) -> None:
        self.tokens, self.seq_len, self.seed, self.name, self.shuffle = tokens, seq_len, seed, name, shuffle
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.doc_lengths = tokens.sequence_lengths[self.doc_ids].astype(np.int64)
        total = int(self.doc_lengths.sum())
        self.samples_per_epoch = max(0, (total - 1) // seq_len)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = OrderedDict()

    def __len__(self) -> int:
        return self.samples_per_epoch

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(documents in order, their start offsets in the packed stream, sample permutation) of an epoch."""
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        n = len(self.doc_ids)
        if self.shuffle:
            rng = np.random.default_rng(stable_seed(self.seed, self.name, epoch))
            doc_order = rng.permutation(n)
            sample_order: np.ndarray | None = rng.permutation(self.samples_per_epoch)
        else:
            doc_order, sample_order = np.arange(n), None
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths[doc_order], out=starts[1:])
        entry = (self.doc_ids[doc_order], starts, sample_order)
        self._epochs[epoch] = entry
        if len(self._epochs) > self._CACHE_EPOCHS:
            self._epochs.popitem(last=False)
        return entry

    def sample(self, k: int) -> np.ndarray:
        """Sample `k` of the infinite sequence (epoch k // len, position k % len), int64, length seq_len + 1."""
        if self.samples_per_epoch == 0:
            raise DataError(
                f"source {self.name!r} has {int(self.doc_lengths.sum())} tokens, fewer than one sample of "
                f"data.seq_len + 1 = {self.seq_len + 1}; lower data.seq_len or give it weight 0")
        epoch, pos = divmod(int(k), self.samples_per_epoch)
        docs, starts, order = self._epoch(epoch)
        if order is not None:
            pos = int(order[pos])
        begin, need = pos * self.seq_len, self.seq_len + 1
        d = int(np.searchsorted(starts, begin, side="right")) - 1
        pieces, offset = [], begin - int(starts[d])
        while need > 0:
            piece = self.tokens.get(int(docs[d]), offset, need)
            pieces.append(piece)
            need -= len(piece)
            d, offset = d + 1, 0
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sample(i)
