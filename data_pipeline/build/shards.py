"""The corpus as ingest shards, and the sharded dedup stages: exact, minhash, pairs, verify, near.

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

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.cache import write_json_atomic
from data_pipeline.build.config import BuildConfig
from data_pipeline.build.dedup import assign_removals, star_report
from data_pipeline.build.minhash import (
    band_keys,
    flat_keys,
    group_pairs,
    jaccard,
    shingle_hashes,
    shingle_set,
    signatures,
)
from data_pipeline.build.progress import log
from data_pipeline.build.stages import list_shards, read_shard_texts, read_shard_where, run_pool, save_npy_atomic
from framework.base.errors import DataError

EDGE = np.dtype([("b", "<i8"), ("a", "<i8"), ("j", "<f4")])
KEYS_PER_RANGE = 4
"""Band keys per key range, per `partition_docs`: a pairs task sorts about 4 P keys (2M at the default P; about
80 bytes of working set each, 0.6 GB at 16 P)."""
VERIFY_SET_BYTES = 1 << 25
"""Bytes of shingle sets verification holds at once, whatever the partition size and the documents' lengths: a
chunk of candidate pairs ends before the pair whose documents would take it past this, counting 8 bytes for every
shingle of each (`minhash/<s>/*.shingles.npy`, repeats included), so the bound holds before anything is read.
(A fixed 2^14 pairs a chunk held up to 2^15 documents' sets: 80 MB at 300 words, 2.6 GB at 10,000.)"""
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

    def status(self, shard: Shard) -> np.ndarray:
        """Per document of `shard`: 0 kept, 1 exact duplicate, 2 near duplicate (needs exact and near done)."""
        st = np.zeros(shard.n, dtype=np.int8)
        st[exact_removed(self, shard.rank, shard.rank + shard.n) - shard.rank] = 1
        if self.cfg.dedup.near:
            st[near_removed(self, shard.rank, shard.rank + shard.n) - shard.rank] = 2
        return st


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


def exact_path(work: Path, p: int) -> Path:
    return work / "exact" / f"part-{p:05d}.npy"


def exact_stage(index: CorpusIndex, task: int, tasks: int) -> None:
    """Exact duplicates per hash-prefix partition: one copy per hash kept (the best-ranked)."""
    if not index.cfg.dedup.exact:
        return
    _run_units(index, "exact", index.parts(index.cfg.dedup.partition_docs), exact_path, _exact_part, task, tasks)


def _exact_part(job: tuple[int, int]) -> None:
    p, parts = job
    h, r = _gather(_CTX["index"], "ingest", ".hsort.npy", "ingest", *_hash_range(p, parts))
    order = np.lexsort((r, h))
    h, r = h[order], r[order]
    dup = np.zeros(len(h), dtype=bool)
    dup[1:] = h[1:] == h[:-1]
    save_npy_atomic(exact_path(_CTX["index"].work, p), np.sort(r[dup]))


def exact_removed(index: CorpusIndex, lo: int, hi: int) -> np.ndarray:
    """Ranks in [lo, hi) removed as exact duplicates."""
    if not index.cfg.dedup.exact:
        return np.zeros(0, dtype=np.int64)
    out = []
    for p in range(index.parts(index.cfg.dedup.partition_docs)):
        a = _load(exact_path(index.work, p), "exact")
        i0, i1 = _slice(a, lo, hi)
        out.append(np.array(a[i0:i1]))
    return np.sort(np.concatenate(out)).astype(np.int64)


# ---- minhash: band keys of every shard, sorted ----

def minhash_stage(index: CorpusIndex, task: int, tasks: int) -> None:
    """MinHash signatures of each shard (all its documents; depend on the shard alone) and its band keys (exact
    duplicates left out), sorted by key — this task's shards."""
    if not index.cfg.dedup.near:
        return
    _CTX["index"] = index
    jobs = []
    def done(k: int) -> bool:  # a build of code before the shingle counts makes them (and the same signatures)
        return all(index.shards[k].file(stage, suffix).is_file()
                   for stage, suffix in (("bands", ".keys.npy"), ("minhash", SHINGLE_COUNTS)))

    for k in _units(len(index.shards), task, tasks, done):
        shard = index.shards[k]
        for stage in ("minhash", "bands"):
            shard.file(stage, "").parent.mkdir(parents=True, exist_ok=True)
        jobs.append((k, exact_removed(index, shard.rank, shard.rank + shard.n)))
    run_pool(_minhash_shard, jobs, index.cfg.workers, "minhash", "shard")


def _minhash_shard(job: tuple[int, np.ndarray]) -> None:
    k, exact = job
    index: CorpusIndex = _CTX["index"]
    shard, mh = index.shards[k], index.cfg.dedup.minhash
    sig_path, count_path = shard.file("minhash", ".sig.npy"), shard.file("minhash", SHINGLE_COUNTS)
    if not (sig_path.is_file() and count_path.is_file()):
        counts = np.zeros(shard.n, dtype=np.uint32)
        sig = signatures(read_shard_texts(shard.jsonl), mh, counts=counts)
        save_npy_atomic(count_path, counts)
        save_npy_atomic(sig_path, sig)
    rows = np.setdiff1d(np.arange(shard.n), exact - shard.rank)
    keys = band_keys(np.load(sig_path)[rows], mh.bands, mh.rows, mh.probe)
    flat = flat_keys(keys)
    own = np.repeat(rows.astype(np.uint64), keys.shape[1])
    order = np.argsort(flat, kind="stable")
    save_npy_atomic(shard.file("bands", ".keys.npy"), np.stack([flat[order], own[order]]))


def key_ranges(index: CorpusIndex) -> int:
    mh = index.cfg.dedup.minhash
    per_doc = mh.bands * (mh.rows if mh.probe else 1)
    return max(1, math.ceil(index.n * per_doc / (KEYS_PER_RANGE * index.cfg.dedup.partition_docs)))


# ---- pairs: candidate pairs per key range ----

def pairs_path(work: Path, r: int, ranges: int) -> Path:
    return work / "pairs" / f"range-{r:05d}-of-{ranges:05d}.npy"


def pairs_stage(index: CorpusIndex, task: int, tasks: int) -> None:
    """Candidate pairs of each key range: documents sharing a band key (see minhash.group_pairs)."""
    if not index.cfg.dedup.near:
        return
    ranges = key_ranges(index)
    _run_units(index, "pairs", ranges, lambda work, r: pairs_path(work, r, ranges), _pairs_range, task, tasks)


def _pairs_range(job: tuple[int, int]) -> None:
    r, ranges = job
    index: CorpusIndex = _CTX["index"]
    k, ranks = _gather(index, "bands", ".keys.npy", "minhash", *_hash_range(r, ranges))
    pairs = group_pairs(k, ranks)
    order = np.lexsort((pairs[:, 0], pairs[:, 1]))
    save_npy_atomic(pairs_path(index.work, r, ranges), np.stack([pairs[order, 1], pairs[order, 0]]))


# ---- verify: exact Jaccard of the candidate pairs of each rank range ----

def verify_path(work: Path, q: int) -> Path:
    return work / "verify" / f"part-{q:05d}.npy"


def verify_stage(index: CorpusIndex, task: int, tasks: int) -> None:
    """Unique candidate pairs whose worse document falls in each rank range, with their exact shingle Jaccard;
    those reaching `verify_threshold` (all of them when it is null) are the edges."""
    if not index.cfg.dedup.near:
        return
    _run_units(index, "verify", index.parts(index.cfg.dedup.partition_docs), verify_path, _verify_part, task, tasks)


def _verify_part(job: tuple[int, int]) -> None:
    q = job[0]
    index: CorpusIndex = _CTX["index"]
    ranges = key_ranges(index)
    mh, per = index.cfg.dedup.minhash, index.cfg.dedup.partition_docs
    found = []
    for r in range(ranges):
        a = _load(pairs_path(index.work, r, ranges), "pairs")
        i0, i1 = _slice(a[0], q * per, (q + 1) * per)
        found.append(np.array(a[:, i0:i1]))
    ba = np.concatenate(found, axis=1) if found else np.zeros((2, 0), dtype=np.int64)
    order = np.lexsort((ba[1], ba[0]))
    ba = ba[:, order]
    first = np.ones(ba.shape[1], dtype=bool)
    first[1:] = (ba[0, 1:] != ba[0, :-1]) | (ba[1, 1:] != ba[1, :-1])
    ba = ba[:, first]
    edges = np.zeros(ba.shape[1], dtype=EDGE)
    edges["b"], edges["a"] = ba[0], ba[1]
    if mh.verify_threshold is None:
        edges["j"] = np.nan
    elif len(edges):
        edges["j"] = verified_jaccard(edges["a"], edges["b"], lambda ids: index.shingle_sets(ids, mh.ngram),
                                      lambda ids: 8 * index.shingle_counts(ids))
        edges = edges[edges["j"] >= mh.verify_threshold]
    write_json_atomic(verify_path(index.work, q).with_suffix(".json"), {"candidate_pairs": int(ba.shape[1])})
    save_npy_atomic(verify_path(index.work, q), edges)


def verified_jaccard(a: np.ndarray, b: np.ndarray, sets_of: Callable[[np.ndarray], list[np.ndarray]],
                     bytes_of: Callable[[np.ndarray], np.ndarray], budget: int | None = None) -> np.ndarray:
    """Exact Jaccard of each pair (a[i], b[i]) of documents, float32. `sets_of(ids)` gives the shingle sets of
    distinct document ids, sorted; it is asked for one chunk of consecutive pairs at a time, and that chunk's sets
    are let go before the next are read. `bytes_of(ids)` bounds each set's bytes from above; a chunk ends before
    the pair that would take its documents past `budget` bytes (`VERIFY_SET_BYTES`), so no more is held unless
    one pair alone is larger. The values do not depend on the chunking."""
    budget = VERIFY_SET_BYTES if budget is None else budget
    j = np.empty(len(a), dtype=np.float32)
    ids, inverse = np.unique(np.concatenate([a, b]), return_inverse=True)
    cost = np.asarray(bytes_of(ids), dtype=np.int64).tolist()
    ia, ib = inverse[:len(a)].tolist(), inverse[len(a):].tolist()
    start = 0
    while start < len(a):
        chunk: set[int] = set()  # the chunk's documents, as indices into ids
        held, stop = 0, start
        while stop < len(a):
            new = {ia[stop], ib[stop]} - chunk
            add = sum(cost[d] for d in new)
            if held + add > budget and stop > start:
                break
            chunk |= new
            held, stop = held + add, stop + 1
        members = sorted(chunk)  # indices into the sorted ids: their ids come out sorted too
        at = {d: i for i, d in enumerate(members)}
        sets = sets_of(ids[members])
        j[start:stop] = [jaccard(sets[at[x]], sets[at[y]]) for x, y in zip(ia[start:stop], ib[start:stop], strict=True)]
        del sets  # before the next chunk's sets are read, not after: one chunk's sets at a time
        start = stop
    return j


# ---- near: who is removed for whom, in rank order ----

def near_path(work: Path, q: int) -> Path:
    return work / "near" / f"part-{q:05d}.npy"


def near_stage(index: CorpusIndex, out: Path) -> dict[str, Any]:
    """One task: walks the verified edges in rank order; a document is removed iff it has an edge to a kept
    document of better rank, and is assigned to the best-ranked one. Memory: one bit per document plus one rank
    range's edges, then 36 bytes per removed document (its assignment and two `NameTable` entries). Writes
    near/part-Q.npy, the cluster report and near_duplicates.jsonl (every removed document with its
    representative and their Jaccard)."""
    work = index.work
    summary_path = work / "near" / "summary.json"
    if summary_path.is_file():
        return dict(json.loads(summary_path.read_text()))
    (work / "near").mkdir(exist_ok=True)
    parts, per = index.parts(index.cfg.dedup.partition_docs), index.cfg.dedup.partition_docs
    bits = np.zeros((index.n + 7) // 8 + 1, dtype=np.uint8)

    def removed_before(r: np.ndarray) -> np.ndarray:
        return ((bits[r >> 3] >> (r & 7).astype(np.uint8)) & 1).astype(bool)

    candidates = verified = 0
    for q in range(parts):
        edges = _load(verify_path(work, q), "verify")
        candidates += json.loads(verify_path(work, q).with_suffix(".json").read_text())["candidate_pairs"]
        verified += len(edges)
        lo = q * per
        chosen, removed = assign_removals(np.asarray(edges["b"]), np.asarray(edges["a"]), lo,
                                          min(index.n, lo + per), removed_before)
        ranks = lo + np.flatnonzero(removed)
        np.bitwise_or.at(bits, ranks >> 3, (1 << (ranks & 7)).astype(np.uint8))
        if not near_path(work, q).is_file():
            save_npy_atomic(near_path(work, q), np.asarray(edges[chosen]))
    removed_all = [np.load(near_path(work, q)) for q in range(parts)]
    assigned = np.concatenate(removed_all) if removed_all else np.zeros(0, dtype=EDGE)
    names = NameTable(index, np.unique(np.concatenate([assigned["b"], assigned["a"]])), work / "near" / "names")
    report = star_report(assigned["b"], assigned["a"], assigned["j"].astype(np.float64), names.get,
                         candidates=candidates, verified=verified)
    write_json_atomic(out / "cluster_report.json", report)
    _write_pairs_listing(names, out / "near_duplicates.jsonl", removed_all)
    names.close()
    summary = {"removed": len(assigned), "candidate_pairs": candidates, "verified_pairs": verified}
    write_json_atomic(summary_path, summary)
    log(f"near: {candidates:,} candidate pairs, {verified:,} verified, {len(assigned):,} documents removed")
    return summary


class NameTable:
    """`source:where` of a fixed, sorted set of documents (every removed document and every representative),
    resolved in one pass over the shards holding them and kept on disk: a blob of UTF-8 names and their offsets.
    Looking a name up is then one read, where looking each rank range's names up in its shards would re-read a
    shard for every range that has a document in it (ranges x shards at 10^9 documents). Memory: 16 bytes per
    document of the set."""

    def __init__(self, index: CorpusIndex, ranks: np.ndarray, path: Path) -> None:
        self.ranks, self.path = np.asarray(ranks, dtype=np.int64), path
        self.offsets = np.zeros(len(self.ranks) + 1, dtype=np.int64)
        shard = index.shard_of(self.ranks)  # ranks sorted: each shard's documents are one run
        bounds = np.flatnonzero(np.diff(shard, prepend=-1, append=-1))
        with open(path, "wb") as f:
            for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
                encoded = [n.encode("utf-8", "surrogatepass") for n in index.names(self.ranks[lo:hi])]
                self.offsets[lo + 1:hi + 1] = self.offsets[lo] + np.cumsum([len(e) for e in encoded])
                f.write(b"".join(encoded))
        self._fd = os.open(path, os.O_RDONLY)

    def get(self, ranks: Sequence[int] | np.ndarray) -> list[str]:
        at = np.searchsorted(self.ranks, np.asarray(ranks, dtype=np.int64))
        lo, hi = self.offsets[at].tolist(), self.offsets[at + 1].tolist()
        return [os.pread(self._fd, b - a, a).decode("utf-8", "surrogatepass") for a, b in zip(lo, hi, strict=True)]

    def close(self) -> None:
        os.close(self._fd)
        self.path.unlink()


def _write_pairs_listing(names: NameTable, path: Path, parts: Sequence[np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for part in parts:
            for r, k, j in zip(names.get(part["b"]), names.get(part["a"]), part["j"].tolist(), strict=True):
                f.write(json.dumps({"removed": r, "kept": k,
                                    "jaccard": None if math.isnan(j) else round(j, 4)}, ensure_ascii=False) + "\n")
    tmp.replace(path)


def near_removed(index: CorpusIndex, lo: int, hi: int) -> np.ndarray:
    """Ranks in [lo, hi) removed as near duplicates."""
    per = index.cfg.dedup.partition_docs
    out = [np.zeros(0, dtype=np.int64)]
    for q in range(lo // per, (max(lo, hi - 1)) // per + 1):
        b = _load(near_path(index.work, q), "near")["b"]
        i0, i1 = _slice(b, lo, hi)
        out.append(np.array(b[i0:i1]))
    return np.concatenate(out)
