"""The verify stage: the exact Jaccard of each candidate pair from the documents' shingle sets, one rank range per
unit (`verify/part-Q.npy`: the verified edges with their Jaccard), within a bounded memory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from data_pipeline.build.cache import write_json_atomic
from data_pipeline.build.minhash import jaccard
from data_pipeline.build.pairs_stage import key_ranges, pairs_path
from data_pipeline.build.shard_files import save_npy_atomic
from data_pipeline.build.shards import _CTX, EDGE, CorpusIndex, _load, _run_units, _slice

VERIFY_SET_BYTES = 1 << 25
"""Bytes of shingle sets verification holds at once, whatever the partition size and the documents' lengths: a
chunk of candidate pairs ends before the pair whose documents would take it past this, counting 8 bytes for every
shingle of each (`minhash/<s>/*.shingles.npy`, repeats included), so the bound holds before anything is read.
(A fixed 2^14 pairs a chunk held up to 2^15 documents' sets: 80 MB at 300 words, 2.6 GB at 10,000.)"""


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
