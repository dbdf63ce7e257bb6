"""Near-duplicate detection: word n-gram MinHash signatures and LSH banding, vectorized in numpy.

Shingles are word 5-grams (lower-cased `\\w+` words) hashed to 64 bits. Signature k of a document is
min over its shingles x of (a_k * x + b_k) mod 2^64, keeping the top 32 bits — the multiply-add-shift universal
hash family (Dietzfelbinger 1996), so a permutation is one multiply and one add on a whole batch at once,
and taking the top bits after the min equals the min of the top bits. 112 permutations as 14 bands x 8 rows
(FineWeb's setting): a pair with Jaccard J shares at least one band with probability 1 - (1 - J^8)^14
(0.92 at J=0.8, 0.9996 at J=0.9, 0.05 at J=0.5). Candidate pairs are optionally verified by their true
shingle Jaccard, then clustered by union-find.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from framework.errors import ConfigError

_WORDS = re.compile(r"\w+")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_SHINGLE_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant (golden ratio) for combining word hashes


@dataclass(kw_only=True, frozen=True)
class MinHashConfig:
    ngram: int = 5
    """Words per shingle."""
    bands: int = 14
    rows: int = 8
    """bands x rows permutations in all (FineWeb: 14 x 8 = 112)."""
    seed: int = 1
    verify_threshold: float | None = 0.7
    """Keep a candidate pair only if its true shingle Jaccard reaches this (None: trust the bands)."""
    probe: bool = True
    """Also pair documents whose band differs in one row (multi-probe; more candidates, higher recall —
    use with verification)."""

    def validate(self) -> None:
        if self.ngram < 1 or self.bands < 1 or self.rows < 1:
            raise ConfigError(f"dedup.minhash ngram={self.ngram}, bands={self.bands}, rows={self.rows} must be >= 1")
        if self.verify_threshold is not None and not 0 < self.verify_threshold <= 1:
            raise ConfigError(f"dedup.minhash.verify_threshold={self.verify_threshold} must be in (0, 1] or null")

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows


class WordHasher:
    """Stable 64-bit word hashes, memoized (a corpus has far fewer distinct words than words)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._hashes = np.zeros(1 << 16, dtype=np.uint64)

    def __call__(self, words: list[str]) -> np.ndarray:
        ids = self._ids
        n0 = len(ids)
        new = sorted(set(words).difference(ids))  # set algebra and map run in C: ~50 ns a word
        if new:
            ids.update(zip(new, range(n0, n0 + len(new)), strict=True))
            if len(ids) > len(self._hashes):
                self._hashes = np.resize(self._hashes, 2 * len(ids))
            self._hashes[n0:len(ids)] = np.fromiter(
                (xxhash.xxh3_64_intdigest(w.encode("utf-8", "surrogatepass")) for w in new), np.uint64, len(new))
        idx = np.fromiter(map(ids.__getitem__, words), np.int64, len(words))
        return self._hashes[idx]


def shingle_hashes(texts: Sequence[str], ngram: int, hasher: WordHasher) -> tuple[np.ndarray, np.ndarray]:
    """All shingle hashes of a batch of documents, concatenated, and each document's start offset.

    A document with fewer than `ngram` words has one shingle (all its words); an empty one has a single
    shingle of value 0, so every document has a signature.
    """
    words_per_doc = [_WORDS.findall(t.lower()) for t in texts]
    lens = np.fromiter((len(w) for w in words_per_doc), np.int64, len(texts))
    flat = [w for ws in words_per_doc for w in ws]
    wh = hasher(flat) if flat else np.zeros(0, dtype=np.uint64)
    wstart = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lens, out=wstart[1:])
    n_sh = np.maximum(lens - ngram + 1, 1)
    sstart = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(n_sh, out=sstart[1:])
    # Shingle j of doc d starts at word wstart[d] + j; windows are clipped to the document's end.
    doc_of = np.repeat(np.arange(len(texts)), n_sh)
    first = wstart[doc_of] + (np.arange(sstart[-1]) - sstart[doc_of])
    end = wstart[doc_of + 1]
    padded = np.concatenate([wh, np.zeros(ngram, dtype=np.uint64)])
    h = np.zeros(len(first), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for r in range(ngram):
            pos = first + r
            h = h * _SHINGLE_MULT + np.where(pos < end, padded[np.minimum(pos, len(wh))] + np.uint64(r + 1),
                                             np.uint64(0))
        h ^= h >> np.uint64(29)
    return h, sstart


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of the multiply-add-shift hashes; a is odd."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64)
    return a, b


def signatures(texts: Sequence[str], cfg: MinHashConfig, hasher: WordHasher | None = None,
               batch_shingles: int = 1 << 16, keep_shingles: list[np.ndarray] | None = None) -> np.ndarray:
    """MinHash signatures of `texts`: uint32 array of shape (len(texts), bands * rows).

    When `keep_shingles` is a list, each document's sorted distinct shingle hashes are appended to it
    (for Jaccard verification without shingling twice)."""
    hasher = hasher or WordHasher()
    a, b = permutations(cfg.num_perm, cfg.seed)
    out = np.empty((len(texts), cfg.num_perm), dtype=np.uint32)
    buf = np.empty((cfg.num_perm, batch_shingles), dtype=np.uint64)
    i = 0
    while i < len(texts):
        # Grow the batch until it holds about batch_shingles shingles (documents vary a lot in length).
        j, budget = i, 0
        while j < len(texts) and (j == i or budget + len(texts[j]) // 6 < batch_shingles):
            budget += len(texts[j]) // 6 + 1
            j += 1
        h, starts = shingle_hashes(texts[i:j], cfg.ngram, hasher)
        if keep_shingles is not None:
            keep_shingles.extend(np.unique(h[starts[d]:starts[d + 1]]) for d in range(j - i))
        work = buf[:, :len(h)] if len(h) <= buf.shape[1] else np.empty((cfg.num_perm, len(h)), dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.multiply(a[:, None], h[None, :], out=work)
            np.add(work, b[:, None], out=work)
        mins = np.minimum.reduceat(work, starts[:-1], axis=1)  # (num_perm, docs): contiguous rows reduce fast
        out[i:j] = (mins.T >> np.uint64(32)).astype(np.uint32)
        i = j
    return out


def band_keys(sig: np.ndarray, bands: int, rows: int, probe: bool = False) -> np.ndarray:
    """64-bit keys of each document's bands: equal bands give equal keys. Shape (n, bands) or, with `probe`,
    (n, bands * rows): one key per band with each one of its rows left out, so bands that differ in a single
    row also meet (multi-probe LSH, Lv et al. 2007)."""
    n = sig.shape[0]
    s = sig.reshape(n, bands, rows).astype(np.uint64)
    mult = (np.arange(rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * _SHINGLE_MULT
    skips = list(range(rows)) if probe else [-1]
    out = []
    with np.errstate(over="ignore"):
        for skip in skips:
            keys = np.full((n, bands), np.uint64(skip + 1))
            for r in range(rows):
                if r != skip:
                    keys = (keys ^ (s[:, :, r] * mult[r])) * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(r)
            out.append(keys)
    return np.concatenate(out, axis=1)


def candidate_pairs(keys: np.ndarray, small_group: int = 8) -> np.ndarray:
    """Pairs (i, j), i < j, of documents sharing a key in any column; shape (m, 2), unique.

    Within a group of at most `small_group` documents every pair is listed; in larger groups each member is
    paired with the group's first (enough for union-find, and it keeps pathological buckets linear).
    """
    pairs = []
    n = keys.shape[0]
    for col in range(keys.shape[1]):
        order = np.argsort(keys[:, col], kind="stable")
        ks = keys[order, col]
        starts = np.concatenate([[0], np.flatnonzero(ks[1:] != ks[:-1]) + 1])
        sizes = np.diff(np.concatenate([starts, [n]]))
        for size in np.unique(sizes[(sizes > 1) & (sizes <= small_group)]):
            members = order[starts[sizes == size][:, None] + np.arange(size)]  # (groups, size)
            ii, jj = np.triu_indices(int(size), 1)
            pairs.append(np.stack([members[:, ii].ravel(), members[:, jj].ravel()], axis=1))
        for s, size in zip(starts[sizes > small_group], sizes[sizes > small_group], strict=True):
            members = np.sort(order[s:s + size])
            pairs.append(np.stack([np.full(size - 1, members[0]), members[1:]], axis=1))
    if not pairs:
        return np.zeros((0, 2), dtype=np.int64)
    allp = np.sort(np.concatenate(pairs).astype(np.int64), axis=1)
    return np.unique(allp, axis=0)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sets of shingle hashes, each given sorted and distinct."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / max(1, len(a) + len(b) - inter)


def union_find(n: int, edges: Iterable[tuple[int, int]]) -> np.ndarray:
    """Component label (the smallest member index) of each of `n` nodes."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j in edges:
        ri, rj = find(int(i)), find(int(j))
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    return np.array([find(x) for x in range(n)], dtype=np.int64)
