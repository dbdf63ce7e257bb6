"""The corpus as ingest shards, and what the sharded dedup stages share (exact_stage.py, minhash_stage.py,
pairs_stage.py, verify_stage.py, near_stage.py: one stage each).

Every document has a rank: its place in keep-preference order (sources by `priority`, highest first, then in
config order; within a source, ingest order). Dedup works in rank space, so "keep the preferred copy" is "keep the
smaller rank", and every output is a pure function of the ingested shards — never of how many tasks ran.

Each sharded stage splits its work into units (partitions of the hash space, shards, key ranges, rank ranges)
numbered independently of the task count; task K of N does the units u with u % N == K, in worker processes, and
skips a unit whose output exists. A stage that needs another stage's output from every task raises DataError
naming it when that output is missing (each stage of a SLURM build is its own array job). Layout under `work/`:

    ingest/<s>/shard-U-K.hsort.npy  (2, m) uint64: the shard's document hashes sorted, and their rows
    exact/part-P.npy                ranks of exact duplicates among the hashes of prefix range P (of E), sorted
    minhash/<s>/shard-U-K.sig.npy   MinHash signatures (uint32, docs x bands*rows) of every document
    minhash/<s>/shard-U-K.shingles.npy  shingles of every document (uint32, repeats counted): what bounds the
                                    bytes of its shingle set before verify reads it
    bands/<s>/shard-U-K.keys.npy    (2, m) uint64: band keys (band folded in) sorted, and their rows; exact
                                    duplicates left out (the minhash stage writes both)
    pairs/range-R-of-N.npy          (2, m) int64: candidate pairs [worse rank; better rank] of key range R of N
                                    (= R_n; the name states the layout, so a build resumed by code with another
                                    layout never mixes ranges), sorted
    verify/part-Q.npy               (b, a, j): verified edges, worse rank b in rank range Q (of Q_n), sorted by
                                    (b, a), with their Jaccard j; part-Q.json: candidate pairs examined
    near/part-Q.npy                 (b, a, j): each removed document b of rank range Q with its representative a
    near/summary.json               the near stage's counts; written last: near dedup done

Partition counts follow `dedup.partition_docs` (P): E = Q_n = ceil(n / P) and R_n = ceil(n * keys per document /
(4 P)); a task holds one unit's data (docs/DATA.md, "Sharding", gives the memory per task).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.config import BuildConfig
from data_pipeline.build.minhash import shingle_set
from data_pipeline.build.shard_files import list_shards, read_shard_texts, read_shard_where
from data_pipeline.build.shingles import shingle_hashes
from data_pipeline.build.workers import run_pool
from framework.base.errors import DataError

EDGE = np.dtype([("b", "<i8"), ("a", "<i8"), ("j", "<f4")])


_U64 = 1 << 64
SHINGLE_COUNTS = ".shingles.npy"


@dataclass(frozen=True)
class Shard:
    source: str
    jsonl: Path
    n: int
    rank: int
    """Rank of the shard's first document (its documents have consecutive ranks)."""

    def file(self, stage: str, suffix: str) -> Path:
        return self.jsonl.parents[2] / stage / self.source / self.jsonl.name.replace(".jsonl", suffix)


class CorpusIndex:
    """Every ingested shard with its rank range; O(shards) memory."""

    def __init__(self, cfg: BuildConfig, work: Path) -> None:
        self.cfg, self.work = cfg, work
        by_source: dict[str, list[tuple[Path, int]]] = {}
        for src in cfg.sources:
            if not (work / "ingest" / src.name / "counts.json").is_file():
                raise DataError(f"source {src.name!r} has not finished ingest ({work / 'ingest' / src.name}/"
                                f"counts.json is missing); run `tessera data build CONFIG --stages ingest` for "
                                f"every task first")
            by_source[src.name] = [(p, int(np.load(p.with_name(p.name.replace(".jsonl", ".hash.npy")),
                                                   mmap_mode="r").shape[0]))
                                   for p in list_shards(work, "ingest", src.name, ".jsonl")]
        order = sorted(range(len(cfg.sources)), key=lambda i: (-cfg.sources[i].priority, i))
        rank, first_rank = 0, {}
        for i in order:
            first_rank[i] = rank
            rank += sum(n for _, n in by_source[cfg.sources[i].name])
        self.n = rank
        self.shards: list[Shard] = []
        for i, src in enumerate(cfg.sources):
            r = first_rank[i]
            for path, n in by_source[src.name]:
                self.shards.append(Shard(src.name, path, n, r))
                r += n
        self.by_rank = np.argsort([s.rank for s in self.shards], kind="stable")
        self.rank_starts = np.array([self.shards[k].rank for k in self.by_rank], dtype=np.int64)

    def parts(self, per: int) -> int:
        return max(1, math.ceil(self.n / per))

    def shard_of(self, ranks: np.ndarray) -> np.ndarray:
        """Index into `shards` of the shard holding each rank."""
        return self.by_rank[np.searchsorted(self.rank_starts, ranks, side="right") - 1]

    def _rows_by_shard(self, ranks: np.ndarray) -> Iterator[tuple[Shard, list[int], np.ndarray, np.ndarray]]:
        """Per shard holding some of `ranks`: the shard, its distinct rows among them (sorted), and for each of
        their positions in `ranks` (`pos`) the index of its row (`inverse`)."""
        shard = self.shard_of(ranks)
        order = np.lexsort((ranks, shard))
        bounds = np.flatnonzero(np.diff(shard[order], prepend=-1, append=-1))
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            s = self.shards[int(shard[order[lo]])]
            pos = order[lo:hi]
            rows, inverse = np.unique(ranks[pos] - s.rank, return_inverse=True)
            yield s, rows.tolist(), pos, inverse

    def shingle_sets(self, ranks: np.ndarray, ngram: int) -> list[np.ndarray]:
        """The distinct shingle hashes (sorted) of documents by rank. Shard by shard, only their lines decoded,
        shingled in batches (`word_hashes`' bound); only the sets are held, never a shard's texts."""
        ranks = np.asarray(ranks, dtype=np.int64)
        out: list[np.ndarray] = [np.zeros(0, dtype=np.uint64)] * len(ranks)
        for s, rows, pos, inverse in self._rows_by_shard(ranks):
            h, off = shingle_hashes(read_shard_texts(s.jsonl, rows), ngram)
            sets = [shingle_set(h[off[i]:off[i + 1]]) for i in range(len(rows))]
            for p, i in zip(pos.tolist(), inverse.tolist(), strict=True):
                out[p] = sets[i]
        return out

    def shingle_counts(self, ranks: np.ndarray) -> np.ndarray:
        """Shingles (repeats counted) of documents by rank, from the minhash stage: an upper bound of the
        distinct ones `shingle_sets` holds."""
        ranks = np.asarray(ranks, dtype=np.int64)
        out = np.zeros(len(ranks), dtype=np.int64)
        for s, rows, pos, inverse in self._rows_by_shard(ranks):
            out[pos] = np.asarray(_load(s.file("minhash", SHINGLE_COUNTS), "minhash")[rows])[inverse]
        return out

    def names(self, ranks: np.ndarray | Sequence[int]) -> list[str]:
        """`source:where` of documents by rank: shard by shard, each shard read once per call and only the
        documents' lines decoded."""
        ranks = np.asarray(ranks, dtype=np.int64)
        out: list[str] = [""] * len(ranks)
        for s, rows, pos, inverse in self._rows_by_shard(ranks):
            wheres = read_shard_where(s.jsonl, rows)
            for p, i in zip(pos.tolist(), inverse.tolist(), strict=True):
                out[p] = f"{s.source}:{wheres[i]}"
        return out


def _missing(path: Path, stage: str) -> DataError:
    return DataError(f"{path} is missing: the {stage} stage has not finished for every task; run `tessera data "
                     f"build CONFIG --stages {stage}` (all tasks) first")


def _load(path: Path, stage: str) -> np.ndarray:
    """A stage's array, memory-mapped. Keep only copies of what you slice from it: the kernel maps whole large
    page-cache folios into the process (measured: 5.7 MB of RSS per 9 MB key file for a 0.6 MB slice), so views
    kept across hundreds of files add up to gigabytes of RSS."""
    if not path.is_file():
        raise _missing(path, stage)
    return np.load(path, mmap_mode="r")


def _slice(sorted_row: np.ndarray, lo: int, hi: int | None) -> tuple[int, int]:
    """Index bounds of the values in [lo, hi) of a sorted array (hi None: to the end)."""
    i0 = int(np.searchsorted(sorted_row, np.uint64(lo) if sorted_row.dtype == np.uint64 else lo))
    if hi is None:
        return i0, len(sorted_row)
    return i0, int(np.searchsorted(sorted_row, np.uint64(hi) if sorted_row.dtype == np.uint64 else hi))


def _hash_range(p: int, parts: int) -> tuple[int, int | None]:
    """The p-th of `parts` equal ranges of the 64-bit hash space (the last one open-ended)."""
    return (p * _U64) // parts, None if p == parts - 1 else ((p + 1) * _U64) // parts


def _units(count: int, task: int, tasks: int, done: Any) -> list[int]:
    return [u for u in range(count) if u % tasks == task and not done(u)]


def _run_units(index: CorpusIndex, stage: str, count: int, path: Any, fn: Any, task: int, tasks: int) -> None:
    """Units u < count of a stage with u % tasks == task whose output `path(work, u)` is missing, each in a process
    forked for it alone (`run_forked`: a unit's peak RSS does not depend on the units before it in the task)."""
    (index.work / stage).mkdir(exist_ok=True)
    _CTX["index"] = index
    jobs = [(u, count) for u in _units(count, task, tasks, lambda u: path(index.work, u).is_file())]
    run_pool(fn, jobs, index.cfg.workers, stage, isolate=True)


def _gather(index: CorpusIndex, stage: str, suffix: str, needs: str, lo: int, hi: int | None
            ) -> tuple[np.ndarray, np.ndarray]:
    """From every shard's sorted (2, m) file, the values in [lo, hi) of its first row and their ranks. The
    slices are sized first and copied into two arrays made once: a list of slices concatenated at the end would
    hold the range twice at its peak (measured: 60 MB of a pairs task's 2 x 10^6 keys instead of 30)."""
    bounds = []
    for shard in index.shards:
        bounds.append(_slice(_load(shard.file(stage, suffix), needs)[0], lo, hi))
    values = np.empty(sum(i1 - i0 for i0, i1 in bounds), dtype=np.uint64)
    ranks = np.empty(len(values), dtype=np.int64)
    at = 0
    for shard, (i0, i1) in zip(index.shards, bounds, strict=True):
        if i1 > i0:
            a = _load(shard.file(stage, suffix), needs)
            values[at:at + i1 - i0] = a[0, i0:i1]  # copies: a view would keep the file mapped
            ranks[at:at + i1 - i0] = a[1, i0:i1]
            ranks[at:at + i1 - i0] += shard.rank
            at += i1 - i0
    return values, ranks


# ---- exact: hash-prefix partitions ----

_CTX: dict[str, Any] = {}  # the index for forked workers (set before the pool starts)
