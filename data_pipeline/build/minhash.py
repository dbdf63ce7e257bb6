"""Near-duplicate detection: word n-gram MinHash signatures and LSH banding, vectorized in numpy.

Shingles are word 5-grams (lower-cased words: runs of letters, digits and '_'; in scripts written without spaces,
each character: data_pipeline/build/shingles.py) hashed to 64 bits, with the words found and hashed over the bytes
of a whole batch at once. Signature values (default scheme "oph"): one
permutation hashing with optimal densification (Li, Owen & Zhang 2012; Shrivastava 2017) — each shingle hashed
once, its hash picking one of bands x rows bins and the bin keeping the least value; empty bins borrow from
filled ones in a fixed random order. Two documents agree on a value with probability their Jaccard J, as with
bands x rows independent permutations (scheme "kperm": (a_k * x + b_k) mod 2^64, top 32 bits — Dietzfelbinger
1996's multiply-add-shift, one hash per shingle and permutation, the scheme before), at 1/(bands x rows) of the
hashing.

Banding: a pair with Jaccard J shares at least one of b bands of r rows with probability 1 - (1 - J^r)^b. The
default, 20 bands x 5 rows (100 values), gives 0.9996 at J=0.8, 0.975 at J=0.7 and 0.47 at J=0.5: the curve of
FineWeb's 14 x 8 with one-row multi-probe (`probe`: bands that differ in one row also meet; 0.9999, 0.984 and
0.39 there) at 20 band keys a document instead of 112, so the pairs stage sorts, writes and reads 5.6x fewer
keys. Plain 14 x 8 (0.92 at J=0.8, 0.56 at J=0.7, 0.05 at J=0.5) trusts its bands without verification; the
default's candidates below J=0.75 (0.9955 of the pairs at J=0.75 are candidates) are what the verification by true
shingle Jaccard drops. Candidates are then clustered.

Verification threshold 0.75: the middle of the margin between what must be found (pairs of J >= 0.8) and what must
not be removed (pairs below 0.7), where J is measured in another tokenization than these words. Two tokenizations
of one pair disagree by a few points: on the bench's known pairs of whitespace-token Jaccard 0.6-0.8, these words
put code 0.02 higher at the median and 0.07 at the 90th percentile (one whitespace token `self.x(y,` is three
words, so a scattered edit of it costs fewer word shingles), prose pairs edited at random positions the same, and
natural prose pairs 0.002. At 0.7, a tenth of the removed documents (pair precision 0.90-0.91 on both bench
corpora at 10^5) fall below 0.7 in whitespace tokens; at 0.75 it is 0.96, and the share of J >= 0.8 pairs with a
copy removed is what 0.7 gives (0.999 prose, 1.000 code). docs/BENCHMARKS.md, "The verification threshold is
0.75".
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from data_pipeline.build.shingles import _SHINGLE_MULT, mix64, shingle_hashes, sorted_distinct
from framework.base.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class MinHashConfig:
    ngram: int = 5
    """Words per shingle."""
    bands: int = 20
    rows: int = 5
    """bands x rows signature values in all. 20 x 5 (100) with verification is the default; FineWeb's 14 x 8 (112)
    is the steeper curve for trusting the bands alone (see the module docstring)."""
    seed: int = 1
    verify_threshold: float | None = 0.75
    """Keep a candidate pair only if its true shingle Jaccard reaches this (None: trust the bands). 0.75 sits between
    the 0.7 below which a pair must not be removed and the 0.8 at which it must be (see the module docstring)."""
    probe: bool = False
    """Also pair documents whose band differs in one row (multi-probe: one key per band and left-out row, bands x
    rows keys a document; more candidates — use with verification). Off by default: more bands of fewer rows give
    the same curve with fewer keys."""
    scheme: Literal["oph", "kperm"] = "oph"
    """How the bands x rows signature values are made. "oph": one permutation hashing with optimal
    densification — one hash per shingle, each landing in one of bands x rows bins (`oph_signatures`);
    "kperm": bands x rows independent multiply-add-shift permutations of every shingle, bands x rows times the
    hashing work (the scheme before; same collision probability J per value)."""

    def validate(self) -> None:
        if self.ngram < 1 or self.bands < 1 or self.rows < 1:
            raise ConfigError(f"dedup.minhash ngram={self.ngram}, bands={self.bands}, rows={self.rows} must be >= 1")
        if self.verify_threshold is not None and not 0 < self.verify_threshold <= 1:
            raise ConfigError(f"dedup.minhash.verify_threshold={self.verify_threshold} must be in (0, 1] or null")
        if self.scheme not in ("oph", "kperm"):
            raise ConfigError(f"dedup.minhash.scheme={self.scheme!r} must be 'oph' (default) or 'kperm'")

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of the multiply-add-shift hashes of scheme "kperm"; a is odd."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64)
    return a, b


@functools.lru_cache(maxsize=8)
def densify_orders(bins: int, seed: int) -> tuple[np.uint64, np.ndarray]:
    """Scheme "oph": the salt of the one shingle hash, and for every bin i a random order of all bins (row i),
    the order in which an empty bin i looks for a filled one to borrow from."""
    rng = np.random.default_rng([seed, 0x0FF])
    salt = rng.integers(0, 1 << 63, dtype=np.uint64)
    return np.uint64(salt), np.argsort(rng.random((bins, bins)), axis=1, kind="stable")


_EMPTY = np.uint32(0xFFFFFFFF)


def oph_signatures(h: np.ndarray, starts: np.ndarray, bins: int, seed: int) -> np.ndarray:
    """One permutation hashing with optimal densification (Li et al. 2012; Shrivastava 2017): (docs, bins) uint32.

    Each shingle is hashed once (splitmix64 of the shingle hash and a salt); the top 32 bits pick its bin
    (multiply-high into [0, bins)), the low 32 bits are its value, and each bin keeps the least value of the
    document's shingles that fall in it — one hash per shingle instead of one per shingle and permutation. A
    bin no shingle fell in takes the value of the first filled bin in its own fixed random order of the bins:
    the same order for every document, so the result is still a function of the shingle set, and two
    documents agree on a bin with probability exactly their Jaccard (Shrivastava 2017, Theorem 3.1; a fixed
    random order is the first-occurrence order of the paper's random probe sequence). A bin whose least value
    is 2^32 - 1 counts as empty (probability 2^-32 a bin; still a function of the set).
    """
    salt, order = densify_orders(bins, seed)
    docs = len(starts) - 1
    with np.errstate(over="ignore"):
        y = mix64(h ^ salt)
        cell = (y >> np.uint64(32)) * np.uint64(bins) >> np.uint64(32)
        cell += np.repeat(np.arange(docs, dtype=np.uint64) * np.uint64(bins), np.diff(starts))
    flat = np.full(docs * bins, _EMPTY, dtype=np.uint32)
    np.minimum.at(flat, cell.view(np.int64), y.astype(np.uint32))  # cell < docs * bins: the same values, no copy
    sig = flat.reshape(docs, bins)
    empty = sig == _EMPTY
    d, i = np.nonzero(empty)
    for t in range(bins):  # each pass settles the empty bins whose t-th choice is filled
        if not len(d):
            break
        c = order[i, t]
        hit = ~empty[d, c]
        sig[d[hit], i[hit]] = sig[d[hit], c[hit]]
        d, i = d[~hit], i[~hit]
    return sig


def signatures(texts: Sequence[str], cfg: MinHashConfig, batch_shingles: int = 1 << 14,
               keep_shingles: list[np.ndarray] | None = None, counts: np.ndarray | None = None) -> np.ndarray:
    """MinHash signatures of `texts`: uint32 array of shape (len(texts), bands * rows), by `cfg.scheme`.

    When `keep_shingles` is a list, each document's shingle hashes are appended to it (for Jaccard
    verification without shingling twice). When `counts` is given (one slot a text), each document's number of
    shingles (repeats counted: at least its distinct ones) is written into it."""
    out = np.empty((len(texts), cfg.num_perm), dtype=np.uint32)
    if cfg.scheme == "kperm":
        a, b = permutations(cfg.num_perm, cfg.seed)
        buf = np.empty((cfg.num_perm, batch_shingles), dtype=np.uint64)
    else:
        batch_shingles *= 4  # one hash per shingle: larger batches, fewer Python calls
    # Batches of about batch_shingles shingles (documents vary a lot in length), guessed at one shingle per 6
    # characters: a batch ends before the document that would take its guess past batch_shingles.
    guess = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)) // 6 + 1, out=guess[1:])
    i = 0
    while i < len(texts):
        j = max(i + 1, int(np.searchsorted(guess, guess[i] + batch_shingles, side="right")) - 1)
        h, starts = shingle_hashes(texts[i:j], cfg.ngram)
        if counts is not None:
            counts[i:j] = np.diff(starts)
        if keep_shingles is not None:  # views by plain slicing: np.split costs some 2 us a piece in Python
            keep_shingles.extend([h[a:b] for a, b in itertools.pairwise(starts.tolist())])
        if cfg.scheme != "kperm":
            out[i:j] = oph_signatures(h, starts, cfg.num_perm, cfg.seed)
            i = j
            continue
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
    mult = (np.arange(rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * _SHINGLE_MULT
    skips = list(range(rows)) if probe else [-1]
    out = np.empty((n, bands * len(skips)), dtype=np.uint64)
    block = 1 << 14  # documents at a time: the temporaries stay small and reused (fresh pages are not free)
    with np.errstate(over="ignore"):
        for lo in range(0, n, block):
            s = sig[lo:lo + block].reshape(-1, bands, rows).astype(np.uint64)
            for c, skip in enumerate(skips):
                keys = np.full((len(s), bands), np.uint64(skip + 1))
                for r in range(rows):
                    if r != skip:
                        keys ^= s[:, :, r] * mult[r]
                        keys *= np.uint64(0xBF58476D1CE4E5B9)
                        keys += np.uint64(r)
                out[lo:lo + block, c * bands:(c + 1) * bands] = keys
    return out


def flat_keys(keys: np.ndarray) -> np.ndarray:
    """One 64-bit key per (document, band column), the column folded in, so a single sorted list of keys holds
    every band (equal values in different bands never meet): shape (n * columns,), row-major."""
    cols = np.arange(keys.shape[1], dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        return mix64(keys ^ (cols[None, :] * _SHINGLE_MULT)).ravel()


def group_pairs(keys: np.ndarray, ids: np.ndarray, small_group: int = 8) -> np.ndarray:
    """Pairs (i, j), i < j, of ids sharing a key; shape (m, 2), unique, sorted.

    Within a group of at most `small_group` ids every pair is listed; in larger groups each member is paired with
    the group's smallest id (enough for union-find, and it keeps pathological buckets linear). The pairs depend
    only on which ids share which keys, so any partition of the key space gives the same pairs.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if len(keys) < 2:
        return np.zeros((0, 2), dtype=np.int64)
    keys, ids = _repeated(np.asarray(keys, dtype=np.uint64), ids)
    order = np.argsort(keys)  # not stable (a vectorized sort, several times lexsort's speed): pairs are ordered below
    ks, members_all = keys[order], ids[order]
    starts = np.concatenate([[0], np.flatnonzero(ks[1:] != ks[:-1]) + 1])
    sizes = np.diff(np.concatenate([starts, [len(ks)]]))
    pairs = []
    for size in sorted_distinct(sizes[(sizes > 1) & (sizes <= small_group)]):
        members = members_all[starts[sizes == size][:, None] + np.arange(size)]  # (groups, size)
        ii, jj = np.triu_indices(int(size), 1)
        pairs.append(np.stack([members[:, ii].ravel(), members[:, jj].ravel()], axis=1))
    big = sizes > small_group
    if big.any():
        in_big = np.repeat(big, sizes)
        smallest = np.minimum.reduceat(members_all, starts)[big]
        pairs.append(np.stack([np.repeat(smallest, sizes[big]), members_all[in_big]], axis=1))
    if not pairs:
        return np.zeros((0, 2), dtype=np.int64)
    allp = np.concatenate(pairs)
    allp = np.stack([allp.min(axis=1), allp.max(axis=1)], axis=1)
    allp = allp[allp[:, 0] != allp[:, 1]]  # one document repeating a key (two columns folded alike)
    return unique_pairs(allp)


FILTER_MIN = 1 << 12
"""Keys from which `_repeated` runs its counting filter before the sort (below it the sort alone is cheaper)."""


def _repeated(keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries of `keys` (and their ids) whose key may occur more than once: the few that `group_pairs` must
    argsort. Found by a value sort of the keys with each one's position packed into its low bits (numpy's value
    sort of uint64 is vectorized, 5-6x its argsort at 10^7 keys, whose cache misses grow with the size) and
    grouping on the high bits left. Equal keys always agree there, so no repeated key is missed; the few
    unequal keys that meet only in the high bits are split again by the exact argsort that follows.

    Above `FILTER_MIN` keys a counting filter goes first: the keys' low bits index a table of about 2-4 slots a
    key (at most 2^22, 32 MB), and only keys whose slot is hit twice are sorted. Equal keys share a slot, so
    none is lost. With the band keys' uniform low bits that leaves 20-40% of them: 1.45-1.75x on a real range
    of 7 x 10^5 keys."""
    m = len(keys)
    if m >= FILTER_MIN:
        table = 1 << min(22, (2 * m - 1).bit_length())
        slot = (keys & np.uint64(table - 1)).astype(np.intp)
        hit = np.bincount(slot, minlength=table) > 1  # gathered as a bool table, not as the int64 counts
        maybe = np.flatnonzero(hit[slot])
        del slot, hit
        keys, ids = keys[maybe], ids[maybe]
        m = len(keys)
    bits = np.uint64(max(1, (m - 1).bit_length()))
    low = (np.uint64(1) << bits) - np.uint64(1)
    packed = keys & ~low
    packed |= np.arange(m, dtype=np.uint64)
    packed.sort()
    hi = packed >> bits
    meets = hi[1:] == hi[:-1]
    del hi
    member = np.zeros(m, dtype=bool)
    member[1:] = meets
    member[:-1] |= meets
    pos = (packed[member] & low).astype(np.int64)
    return keys[pos], ids[pos]


def unique_pairs(pairs: np.ndarray) -> np.ndarray:
    """`np.unique(pairs, axis=0)` of non-negative int64 pairs (m, 2), as one 1-D sort of i * span + j when that
    fits in int64 (a row-wise unique sorts a structured view, several times slower)."""
    if not len(pairs):
        return pairs.reshape(0, 2)
    span = int(pairs.max()) + 1
    if span > np.iinfo(np.int64).max // span:
        return np.unique(pairs, axis=0)
    code = sorted_distinct(pairs[:, 0] * span + pairs[:, 1])
    return np.stack([code // span, code % span], axis=1)


RANGE_KEYS = 1 << 21
"""Keys `candidate_pairs` groups at once: it splits larger inputs into ranges of the key space, as the build's
`pairs` stage does on disk, so no array it sorts or allocates is larger than about 16 MB."""


def candidate_pairs(keys: np.ndarray, small_group: int = 8, range_keys: int = RANGE_KEYS) -> np.ndarray:
    """Pairs (i, j), i < j, of documents sharing a key in any column of `keys` (n, columns); see `group_pairs`.

    More than `range_keys` keys are split by their top bits into ranges of about that many, block by block of
    documents (a stable radix argsort of the range numbers), and each range is grouped alone: the same pairs
    (any partition of the key space gives them), without sorting all n x columns keys in one array — fresh
    pages of large arrays cost as much as the sort itself on some machines (25 ns per uint64 measured on one).
    """
    n, cols = keys.shape
    total = n * cols
    if total <= range_keys:
        return group_pairs(flat_keys(keys), np.repeat(np.arange(n, dtype=np.int64), cols), small_group)
    bits = min(16, math.ceil(math.log2(total / range_keys)))
    parts, shift = 1 << bits, np.uint64(64 - bits)
    held_keys: list[list[np.ndarray]] = [[] for _ in range(parts)]
    held_ids: list[list[np.ndarray]] = [[] for _ in range(parts)]
    rows = max(1, range_keys // cols, -(-n // 64))  # at most 64 blocks: parts x blocks arrays are held
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        flat = flat_keys(keys[lo:hi])
        part = (flat >> shift).astype(np.uint16)
        order = np.argsort(part, kind="stable")
        cuts = np.cumsum(np.bincount(part, minlength=parts))[:-1]
        ids = (order // cols + lo).astype(np.int64)
        for r, (k, i) in enumerate(zip(np.split(flat[order], cuts), np.split(ids, cuts), strict=True)):
            held_keys[r].append(k)
            held_ids[r].append(i)
    found = []
    for r in range(parts):
        found.append(group_pairs(np.concatenate(held_keys[r]), np.concatenate(held_ids[r]), small_group))
        held_keys[r], held_ids[r] = [], []
    return unique_pairs(np.concatenate(found))


def shingle_set(h: np.ndarray) -> np.ndarray:
    """The distinct shingle hashes of one document, sorted (what `jaccard` takes)."""
    return sorted_distinct(h)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sets of shingle hashes, each given sorted and distinct (`shingle_set`)."""
    both = np.concatenate((a, b))
    both.sort(kind="stable")  # two sorted runs: the stable sort merges them in linear time
    inter = int(np.count_nonzero(both[1:] == both[:-1]))
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
