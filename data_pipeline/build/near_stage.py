"""The near stage: who is removed for whom among the verified edges, in rank order (`near/part-Q.npy`,
`near/summary.json`), and the listing of removed pairs by name.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.cache import write_json_atomic
from data_pipeline.build.dedup import assign_removals, star_report
from data_pipeline.build.exact_stage import exact_removed
from data_pipeline.build.progress import log
from data_pipeline.build.shard_files import save_npy_atomic
from data_pipeline.build.shards import EDGE, CorpusIndex, Shard, _load, _slice
from data_pipeline.build.verify_stage import verify_path


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


def document_status(index: CorpusIndex, shard: Shard) -> np.ndarray:
    """Per document of `shard`: 0 kept, 1 exact duplicate, 2 near duplicate (needs exact and near done)."""
    st = np.zeros(shard.n, dtype=np.int8)
    st[exact_removed(index, shard.rank, shard.rank + shard.n) - shard.rank] = 1
    if index.cfg.dedup.near:
        st[near_removed(index, shard.rank, shard.rank + shard.n) - shard.rank] = 2
    return st
