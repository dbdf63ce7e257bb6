"""The pairs stage: candidate pairs [worse rank; better rank] of the documents sharing a band key, one key range
per unit (`pairs/range-R-of-N.npy`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from data_pipeline.build.minhash import group_pairs
from data_pipeline.build.shard_files import save_npy_atomic
from data_pipeline.build.shards import _CTX, CorpusIndex, _gather, _hash_range, _run_units

KEYS_PER_RANGE = 4
"""Band keys per key range, per `partition_docs`: a pairs task sorts about 4 P keys (2M at the default P; about
80 bytes of working set each, 0.6 GB at 16 P)."""


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
