"""The exact stage: exact duplicates among the documents' hashes, one hash-prefix partition per unit
(`exact/part-P.npy`: the ranks of the duplicates of partition P, sorted).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_pipeline.build.shard_files import save_npy_atomic
from data_pipeline.build.shards import _CTX, CorpusIndex, _gather, _hash_range, _load, _run_units, _slice


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
