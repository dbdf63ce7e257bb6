"""Train-time mixing: a deterministic global order of samples drawn from weighted sources.

Order within a phase: the k-th sample of source i is placed at position (k + 1/2) / w_i and all sources are
merged by position (ties to the lower source index). After N samples every source has been drawn
floor(t * w_i + 1/2) times for a common threshold t, so its count is within about one sample of w_i * N at
every prefix — the same guarantee as Megatron's error-minimizing BlendedDataset assignment, but computed for
all N at once by a sort instead of a Python loop. The order depends only on the weights; which sample of a
source is drawn depends on (seed, source, epoch) in `PackedSource`. World size and loader workers play no part.

Schedules: phase p starts at global sample s_p with its own weights. A source's cursor carries over phase
boundaries (phase p draws source i's samples from where phase p-1 stopped), so a schedule never repeats data
early. Every global index maps to one sample by a pure function, so resuming at `consumed_samples` with the
same schedule is exact; editing a phase that has not started yet leaves every sample already seen unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from data_pipeline.read.packing import PackedSource
from framework.base.errors import DataError


def mixture_order(weights: Sequence[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `n` draws of a mixture: (source index, ordinal within that source) per position.

    Args:
        weights: Non-negative weights (normalized here); a zero weight is never drawn.
        n: Number of positions.

    Returns:
        `src` (int16, shape (n,)) and `ordinal` (int64, shape (n,)): position j draws sample `ordinal[j]` of
        source `src[j]`, and ordinals of each source count 0, 1, 2, ... in order.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or (w < 0).any() or w.sum() <= 0:
        raise DataError(f"mixture weights {list(weights)} must be non-negative with a positive sum")
    w = w / w.sum()
    srcs, ords, poss = [], [], []
    for i, wi in enumerate(w):
        if wi <= 0:
            continue
        k = np.arange(int(np.ceil(wi * n)) + 2, dtype=np.int64)
        srcs.append(np.full(len(k), i, dtype=np.int16))
        ords.append(k)
        poss.append((k + 0.5) / wi)
    src, ordinal, pos = np.concatenate(srcs), np.concatenate(ords), np.concatenate(poss)
    keep = np.lexsort((src, pos))[:n]  # by position, ties to the lower source index
    return src[keep], ordinal[keep]


class MixtureSamples:
    """The weighted mixture of packed sources as one global, deterministic `Samples` sequence.

    Args:
        sources: Packed sources by name.
        phases: `(start_sample, weights by source name)`, first start 0, starts increasing.
        length: Samples in one pass of the mixture; indices wrap around it (epochs of the mixture).
        max_epochs: Per source, how many epochs of it one pass may use (upsampling cap).
    """

    def __init__(self, sources: Mapping[str, PackedSource], phases: Sequence[tuple[int, Mapping[str, float]]],
                 length: int, max_epochs: Mapping[str, float] | None = None) -> None:
        self.names = sorted(sources)
        self.sources = [sources[n] for n in self.names]
        self.phases = [(int(start), dict(weights)) for start, weights in phases]
        self.max_epochs = dict(max_epochs or {})
        if not phases or phases[0][0] != 0 or any(b[0] <= a[0] for a, b in itertools.pairwise(phases)):
            raise DataError(f"mixture phases start at {[p[0] for p in phases]}; they must start at 0 and increase")
        if length < 1:
            raise DataError(f"mixture length {length} must be >= 1; the sources hold no full sample")
        self.length = length
        self.starts = np.array([p[0] for p in phases if p[0] < length], dtype=np.int64)
        self._src: list[np.ndarray] = []
        self._ord: list[np.ndarray] = []
        offsets = np.zeros(len(self.names), dtype=np.int64)
        self._offsets: list[np.ndarray] = []
        for p, start in enumerate(self.starts):
            stop = int(self.starts[p + 1]) if p + 1 < len(self.starts) else length
            w = self._weights(phases[p][1])
            src, ordinal = mixture_order(w, stop - int(start))
            self._src.append(src)
            self._ord.append(ordinal)
            self._offsets.append(offsets.copy())
            offsets += np.bincount(src, minlength=len(self.names))
        self.draws = dict(zip(self.names, offsets.tolist(), strict=True))
        self._check_caps(max_epochs or {})

    def _weights(self, weights: Mapping[str, float]) -> list[float]:
        unknown = sorted(set(weights) - set(self.names))
        if unknown:
            raise DataError(f"mixture weights name sources {unknown} that the data does not have; "
                            f"known sources: {self.names}")
        w = [float(weights.get(n, 0.0)) for n in self.names]
        for name, wi, s in zip(self.names, w, self.sources, strict=True):
            if wi > 0 and len(s) == 0:
                raise DataError(f"source {name!r} has weight {wi} but no full sample of seq_len + 1 tokens; "
                                f"set its weight to 0 or lower data.seq_len")
        return w

    def _check_caps(self, max_epochs: Mapping[str, float]) -> None:
        for name, s in zip(self.names, self.sources, strict=True):
            cap = max_epochs.get(name)
            used = self.draws[name] / max(1, len(s))
            if cap is not None and used > cap + 1e-9:
                raise DataError(
                    f"source {name!r} would be read {used:.2f} times (its epoch cap is {cap}) in one pass of "
                    f"{self.length} samples; lower its weight, raise its max_epochs, or set data.num_samples")

    def with_phases(self, phases: Sequence[tuple[int, Mapping[str, float]]]) -> MixtureSamples:
        """This mixture with more phases `(start sample, weights)` after its last one (online mixing appends one
        per update, and a resume all of the run's at once).

        Every index before the first new start maps to the sample it maps to here; a run that rebuilds the same
        phase list on resume therefore reads exactly what the uninterrupted run read.
        """
        if phases and phases[0][0] <= self.phases[-1][0]:
            raise DataError(f"a new mixture phase must start after the last one (sample {self.phases[-1][0]}); "
                            f"got sample {phases[0][0]}")
        return MixtureSamples(dict(zip(self.names, self.sources, strict=True)), [*self.phases, *phases],
                              self.length, self.max_epochs)

    def epochs_used(self) -> dict[str, float]:
        """Epochs of each source that one pass of the mixture reads."""
        return {n: self.draws[n] / max(1, len(s)) for n, s in zip(self.names, self.sources, strict=True)}

    def __len__(self) -> int:
        return self.length

    def locate(self, j: int) -> tuple[int, int]:
        """(source index, sample index within the source) of global sample `j`."""
        j = int(j) % self.length
        p = int(np.searchsorted(self.starts, j, side="right")) - 1
        local = j - int(self.starts[p])
        src = int(self._src[p][local])
        return src, int(self._offsets[p][src] + self._ord[p][local])

    def __getitem__(self, j: int) -> np.ndarray:
        src, k = self.locate(j)
        return self.sources[src].sample(k)
