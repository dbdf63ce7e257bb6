"""Exact and near deduplication across sources, keeping the copy in the highest-priority source.

Both work on flat arrays over all documents (hash or signature, priority, global order), so the same
functions serve the in-memory benchmark and the sharded on-disk build.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data_pipeline.build.minhash import MinHashConfig, band_keys, candidate_pairs, jaccard, shingle_set, signatures
from data_pipeline.build.shingles import sorted_distinct
from framework.base.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class DedupConfig:
    exact: bool = True
    """Drop documents whose normalized text hashes equal an earlier (or higher-priority) one."""
    near: bool = True
    """MinHash LSH near-duplicate removal."""
    minhash: MinHashConfig = field(default_factory=MinHashConfig)
    partition_docs: int = 1 << 19
    """Documents per partition of the sharded exact and near stages: a task holds about this many documents'
    hashes, band keys or candidate pairs at once (docs/DATA.md, "Sharding"); the result does not depend on it."""

    def validate(self) -> None:
        if self.partition_docs < 1:
            raise ConfigError(f"dedup.partition_docs={self.partition_docs} must be >= 1 (default {1 << 19})")


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
    """Cluster label of every document: a removed document's kept representative, else the document itself — a
    star around one kept document, so a label never chains documents that are not each near the representative."""
    candidates: int
    verified: int
    similarity: np.ndarray | None = None
    """Per document: the verified Jaccard of a removed document with its representative (NaN for kept ones, and
    without verification)."""

    def report(self, limit: int = 50, names: Sequence[str] | None = None) -> dict[str, Any]:
        """Cluster sizes and the largest clusters (the kept representative and what was removed for it)."""
        removed = np.flatnonzero(~self.keep)
        sim = self.similarity if self.similarity is not None else np.full(len(self.keep), np.nan)
        def show(ids: Sequence[int]) -> list[Any]:
            return [names[i] if names is not None else int(i) for i in ids]

        return star_report(removed, self.cluster[removed], sim[removed], show, candidates=self.candidates,
                           verified=self.verified, limit=limit)


def star_report(removed: np.ndarray, rep: np.ndarray, sim: np.ndarray, show: Callable[[Sequence[int]], Sequence[Any]],
                *, candidates: int, verified: int, limit: int = 50) -> dict[str, Any]:
    """The cluster report: clusters are stars (a kept representative and the documents removed for it), with
    their size histogram and the `limit` largest, each removed member with its Jaccard to the representative.
    `show(ids)` names documents, called once for all that the report lists."""
    reps, sizes = np.unique(rep, return_counts=True)
    hist = np.bincount(sizes + 1) if len(reps) else np.zeros(0, dtype=np.int64)
    top = reps[np.argsort(-sizes, kind="stable")][:limit]
    order = np.argsort(rep, kind="stable")
    picked = []
    for r in top.tolist():
        lo, hi = np.searchsorted(rep[order], [r, r + 1])
        picked.append((r, int(hi - lo + 1), order[lo:hi][:20].tolist()))
    shown = iter(show([x for r, _, members in picked for x in [r, *(int(removed[m]) for m in members)]]))
    clusters = []
    for _, size, members in picked:
        clusters.append({"size": size, "kept": next(shown), "removed": [
            {"doc": next(shown), "jaccard": None if np.isnan(sim[m]) else round(float(sim[m]), 4)} for m in members]})
    return {"clusters": len(reps), "removed": len(removed), "candidate_pairs": int(candidates),
            "verified_pairs": int(verified), "size_histogram": {str(s): int(c) for s, c in enumerate(hist) if c},
            "largest": clusters}


def assign_removals(b: np.ndarray, a: np.ndarray, lo: int, hi: int,
                    removed_before: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Which documents of the rank range [lo, hi) are removed, and for which kept document.

    Documents are numbered by keep-preference rank (0 is kept first). Edges (b, a) are verified pairs with a < b,
    sorted by (b, a), every b in [lo, hi); `removed_before(ranks)` says which documents of rank < lo were removed
    (decided already). The rule, in rank order: a document is removed iff it has an edge to a kept document of
    better rank, and it is assigned to the best-ranked such document (its representative). Returns (indexes into
    the edges of the assignments, sorted by b) — one per removed document — and the mask of removed ranks in
    [lo, hi).
    """
    removed = np.zeros(hi - lo, dtype=bool)
    chosen: list[int] = []
    if not len(b):
        return np.zeros(0, dtype=np.int64), removed
    early = a < lo
    gone = np.zeros(len(a), dtype=bool)
    gone[early] = removed_before(a[early])
    starts = np.flatnonzero(np.diff(b, prepend=b[0] - 1))
    ends = np.append(starts[1:], len(b))
    if not (~early).any():  # every representative candidate decided already: vectorized
        kept_edge = np.flatnonzero(~gone)
        pos = np.searchsorted(kept_edge, starts)
        has = pos < len(kept_edge)
        has[has] = kept_edge[pos[has]] < ends[has]
        first = kept_edge[pos[has]]
        removed[b[first] - lo] = True
        return first.astype(np.int64), removed
    al, bl, gl = a.tolist(), b.tolist(), gone.tolist()
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        for k in range(s, e):
            if not (gl[k] if al[k] < lo else removed[al[k] - lo]):
                removed[bl[k] - lo] = True
                chosen.append(k)
                break
    return np.asarray(chosen, dtype=np.int64), removed


def preference_rank(priority: np.ndarray) -> np.ndarray:
    """Rank of every document in keep-preference order: higher priority first, then earlier."""
    return _preference(priority)


def cluster_signatures(sig: np.ndarray, cfg: MinHashConfig, *, priority: np.ndarray | None = None,
                       shingles_of: Callable[[np.ndarray], Sequence[np.ndarray]] | None = None
                       ) -> NearDedupResult:
    """Band the signatures, verify candidate pairs (when configured), remove documents next to kept ones.

    Args:
        sig: (n, bands * rows) MinHash signatures.
        cfg: MinHash settings (bands, rows, probe, verify_threshold).
        priority: Per document; a removed document always has a kept one of higher priority (then earlier).
        shingles_of: Shingle hashes of the given documents; required for verification.
    """
    n = sig.shape[0]
    rank = _preference(np.zeros(n) if priority is None else np.asarray(priority))
    by_rank = np.argsort(rank)
    pairs = candidate_pairs(band_keys(sig[by_rank], cfg.bands, cfg.rows, cfg.probe))  # in rank space
    edges, sims = pairs, np.full(len(pairs), np.nan)
    if cfg.verify_threshold is not None and len(pairs):
        if shingles_of is None:
            raise ValueError("shingles_of is needed to verify candidate pairs")
        sims = verify_pairs(pairs, lambda r: shingles_of(by_rank[r]))
        edges, sims = pairs[sims >= cfg.verify_threshold], sims[sims >= cfg.verify_threshold]
    order = np.lexsort((edges[:, 0], edges[:, 1]))
    b, a, sims = edges[order, 1], edges[order, 0], sims[order]
    chosen, removed = assign_removals(b, a, 0, n, lambda r: np.zeros(len(r), dtype=bool))
    keep = np.ones(n, dtype=bool)
    keep[by_rank[removed]] = False
    cluster = np.arange(n, dtype=np.int64)
    cluster[by_rank[b[chosen]]] = by_rank[a[chosen]]
    similarity = np.full(n, np.nan)
    similarity[by_rank[b[chosen]]] = sims[chosen]
    return NearDedupResult(keep=keep, cluster=cluster, candidates=len(pairs), verified=len(edges),
                           similarity=similarity)


def verify_pairs(pairs: np.ndarray, shingles_of: Callable[[np.ndarray], Sequence[np.ndarray]]) -> np.ndarray:
    """Exact shingle Jaccard of each pair (m, 2) of document ids; `shingles_of(ids)` gives their shingle hashes."""
    involved = sorted_distinct(pairs.ravel())
    sets = {i: shingle_set(h) for i, h in zip(involved.tolist(), shingles_of(involved), strict=True)}
    return np.array([jaccard(sets[i], sets[j]) for i, j in pairs.tolist()], dtype=np.float64)


def near_dedup(texts: Sequence[str], cfg: MinHashConfig, priority: np.ndarray | None = None) -> NearDedupResult:
    """In-memory near dedup of `texts` end to end: shingles, signatures, bands, verification, clusters."""
    kept: list[np.ndarray] | None = [] if cfg.verify_threshold is not None else None
    sig = signatures(texts, cfg, keep_shingles=kept)
    return cluster_signatures(sig, cfg, priority=priority,
                              shingles_of=None if kept is None else (lambda ids: [kept[i] for i in ids]))
