"""The minhash stage: every shard's MinHash signatures, shingle counts and band keys (exact duplicates left out),
sorted, one shard per unit (`minhash/<s>/`, `bands/<s>/`).
"""

from __future__ import annotations

import numpy as np

from data_pipeline.build.exact_stage import exact_removed
from data_pipeline.build.minhash import band_keys, flat_keys, signatures
from data_pipeline.build.shard_files import read_shard_texts, save_npy_atomic
from data_pipeline.build.shards import _CTX, SHINGLE_COUNTS, CorpusIndex, _units
from data_pipeline.build.workers import run_pool


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
