"""Exact and near deduplication across sources, keeping the copy in the highest-priority source.

Both work on flat arrays over all documents (hash or signature, priority, global order), so the same
functions serve the in-memory benchmark and the sharded on-disk build.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data_pipeline.minhash import (
    MinHashConfig,
    band_keys,
    candidate_pairs,
    jaccard,
    signatures,
    union_find,
)


@dataclass(kw_only=True, frozen=True)
class DedupConfig:
    exact: bool = True
    """Drop documents whose normalized text hashes equal an earlier (or higher-priority) one."""
    near: bool = True
    """MinHash LSH near-duplicate removal."""
    minhash: MinHashConfig = field(default_factory=MinHashConfig)


def _preference(priority: np.ndarray) -> np.ndarray:
    """Rank of every document in keep-preference order: higher priority first, then earlier."""
    order = np.lexsort((np.arange(len(priority)), -priority.astype(np.int64)))
    rank = np.empty(len(priority), dtype=np.int64)
    rank[order] = np.arange(len(priority))
    return rank


def exact_keep(hashes: np.ndarray, priority: np.ndarray | None = None) -> np.ndarray:
    """Mask of documents to keep: one per distinct hash, the preferred copy."""
    hashes = np.asarray(hashes, dtype=np.uint64)
    if len(hashes) == 0:
        return np.zeros(0, dtype=bool)
    rank = _preference(np.zeros(len(hashes)) if priority is None else priority)
    order = np.lexsort((rank, hashes))  # by hash, preferred copy first
    first = np.ones(len(order), dtype=bool)
    first[1:] = hashes[order][1:] != hashes[order][:-1]
    keep = np.zeros(len(hashes), dtype=bool)
    keep[order[first]] = True
    return keep


@dataclass
class NearDedupResult:
    keep: np.ndarray
    """Bool mask: False for documents removed as near duplicates."""
    cluster: np.ndarray
    """Component label of every document (its smallest member index); singletons label themselves."""
    candidates: int
    verified: int

    def report(self, limit: int = 50, names: Sequence[str] | None = None) -> dict[str, Any]:
        """Cluster sizes and the largest clusters (kept and removed members), JSON-able."""
        labels, sizes = np.unique(self.cluster, return_counts=True)
        multi = labels[sizes > 1]
        hist = np.bincount(sizes[sizes > 1]) if len(multi) else np.zeros(0, dtype=np.int64)
        top = multi[np.argsort(-sizes[sizes > 1], kind="stable")][:limit]
        show = (lambda i: names[i]) if names is not None else (lambda i: int(i))
        clusters = []
        for lab in top:
            members = np.flatnonzero(self.cluster == lab)
            clusters.append({"size": len(members), "kept": [show(i) for i in members[self.keep[members]]],
                             "removed": [show(i) for i in members[~self.keep[members]]][:20]})
        return {"clusters": len(multi), "removed": int((~self.keep).sum()), "candidate_pairs": self.candidates,
                "verified_pairs": self.verified, "size_histogram": {str(s): int(c) for s, c in enumerate(hist) if c},
                "largest": clusters}


def greedy_keep(n: int, edges: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Which documents survive: in preference order, a document is removed iff it has an edge to a kept one.

    Removing all but one member of a union-find component would drop documents connected only through a
    chain (A~B, B~C, yet A and C far apart); this rule removes a document only next to a kept one, so with
    verified edges every removed document has Jaccard >= threshold with a kept member of its cluster.
    """
    keep = np.ones(n, dtype=bool)
    if not len(edges):
        return keep
    neighbours: dict[int, list[int]] = {}
    for i, j in edges.tolist():
        neighbours.setdefault(i, []).append(j)
        neighbours.setdefault(j, []).append(i)
    for doc in sorted(neighbours, key=lambda d: rank[d]):
        if any(keep[o] and rank[o] < rank[doc] for o in neighbours[doc]):
            keep[doc] = False
    return keep


def cluster_signatures(sig: np.ndarray, cfg: MinHashConfig, *, priority: np.ndarray | None = None,
                       shingles_of: Callable[[np.ndarray], Sequence[np.ndarray]] | None = None
                       ) -> NearDedupResult:
    """Band the signatures, verify candidate pairs (when configured), cluster, keep one per cluster.

    Args:
        sig: (n, bands * rows) MinHash signatures.
        cfg: MinHash settings (bands, rows, probe, verify_threshold).
        priority: Per document; each removal keeps the higher-priority (then earlier) document.
        shingles_of: Shingle hashes of the given documents; required for verification.
    """
    n = sig.shape[0]
    pairs = candidate_pairs(band_keys(sig, cfg.bands, cfg.rows, cfg.probe))
    edges = pairs
    if cfg.verify_threshold is not None and len(pairs):
        if shingles_of is None:
            raise ValueError("shingles_of is needed to verify candidate pairs")
        involved = np.unique(pairs)
        sets = {i: np.unique(h) for i, h in zip(involved.tolist(), shingles_of(involved), strict=True)}
        ok = [jaccard(sets[i], sets[j]) >= cfg.verify_threshold for i, j in pairs.tolist()]
        edges = pairs[np.asarray(ok, dtype=bool)]
    labels = union_find(n, map(tuple, edges))
    keep = greedy_keep(n, edges, _preference(np.zeros(n) if priority is None else np.asarray(priority)))
    return NearDedupResult(keep=keep, cluster=labels, candidates=len(pairs), verified=len(edges))


def near_dedup(texts: Sequence[str], cfg: MinHashConfig, priority: np.ndarray | None = None) -> NearDedupResult:
    """In-memory near dedup of `texts` end to end: shingles, signatures, bands, verification, clusters."""
    kept: list[np.ndarray] | None = [] if cfg.verify_threshold is not None else None
    sig = signatures(texts, cfg, keep_shingles=kept)
    return cluster_signatures(sig, cfg, priority=priority,
                              shingles_of=None if kept is None else (lambda ids: [kept[i] for i in ids]))
