"""Word shingles for near-duplicate detection: lower-cased words (runs of letters, digits and '_', and every byte
of a multi-byte UTF-8 character; in scripts written without spaces, each character: `text_units.shingle_text`)
hashed over the bytes of a whole batch at once, combined into word n-grams
hashed to 64 bits (data_pipeline/build/minhash.py turns them into signatures).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from data_pipeline.text_units import shingle_text, unspaced_table

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_SHINGLE_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant (golden ratio) for combining word hashes


# Bytes that belong to words: ASCII letters, digits, '_' and every byte of a multi-byte UTF-8 character (so
# accented and non-Latin letters stay inside words). On ASCII this is exactly regex `\w+`.
_WORD_BYTE = np.zeros(256, dtype=bool)
_WORD_BYTE[list(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")] = True
_WORD_BYTE[0x80:] = True
_P = 0x100000001B3  # odd multiplier of the polynomial word hash over 8-byte chunks (FNV prime)
_CHUNK_MASK = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)
"""The low k bytes of a little-endian 8-byte chunk: a word's last chunk cut to the bytes it has."""


WORD_BATCH_BYTES = 1 << 24
"""Bytes `word_hashes` hashes at once. A batch peaks at about 12 bytes per input byte (the encoded and translated
copies, the word mask and its edges, and about 60 bytes per word; measured with tracemalloc on prose, 7 on
code), some 200 MB at 16 MiB; a longer input is split at document boundaries (the hashes do not depend on the
split)."""


class _Powers:
    """P^j mod 2^64 for j < n, grown on demand (one cumulative product): the weight of a word's chunk j."""

    def __init__(self) -> None:
        self.pos = np.ones(1, dtype=np.uint64)

    def get(self, n: int) -> np.ndarray:
        if len(self.pos) < n:
            size = max(n, 2 * len(self.pos))
            with np.errstate(over="ignore"):
                self.pos = np.concatenate([[np.uint64(1)], np.cumprod(np.full(size - 1, _P, dtype=np.uint64))])
        return self.pos[:n]


_POWERS = _Powers()


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads every input bit over the whole word."""
    with np.errstate(over="ignore"):
        y = x >> np.uint64(30)  # two arrays in all, worked on in place (x is left as it is)
        y ^= x
        y *= np.uint64(0xBF58476D1CE4E5B9)
        t = y >> np.uint64(27)
        y ^= t
        y *= np.uint64(0x94D049BB133111EB)
        np.right_shift(y, np.uint64(31), out=t)
        y ^= t
        return y


_LOWER_WORD_TABLE = bytes((c | 0x20) if 0x41 <= c <= 0x5A else (c if _WORD_BYTE[c] else 0) for c in range(256))
"""`bytes.translate` table: A-Z to a-z, the other word bytes to themselves (all nonzero), every other byte to 0 —
one C pass gives both the lower-cased bytes and the word mask (nonzero)."""


def word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of the lower-cased words of each text, concatenated, and each text's first word index.

    Vectorized over the bytes of a batch at once, no Python per word: word boundaries from a byte table, then
    each word's bytes read as little-endian 8-byte chunks c_j (the last cut to the word) straight out of the
    batch's buffer, hashed as mix64(sum(c_j P^j) + length) mod 2^64. A word of at most 8 bytes (most words) is
    one gather and a mask, and its hash is injective. Batches hold at most `WORD_BATCH_BYTES`.
    """
    encoded = _lower_encoded(texts)
    groups, start, size = [], 0, 0
    for i, e in enumerate(encoded):
        if size + len(e) + 1 > WORD_BATCH_BYTES and i > start:
            groups.append((start, i))
            start, size = i, 0
        size += len(e) + 1
    groups.append((start, len(encoded)))
    if len(groups) == 1:
        return _word_hashes(encoded)
    hashes, firsts, base = [], [], 0
    for lo, hi in groups:
        h, first = _word_hashes(encoded[lo:hi])
        hashes.append(h)
        firsts.append(first[:-1] + base)
        base += len(h)
    firsts.append(np.array([base], dtype=np.int64))
    return np.concatenate(hashes), np.concatenate(firsts)


_CASE_TABLE_SIZE = 0x20000


@functools.lru_cache(maxsize=1)
def _lower_changes() -> np.ndarray:
    """Whether `str.lower` changes each code point below 0x20000 by itself (every cased character of Unicode 15
    is there; those above are treated as changing, so a later Unicode stays exact)."""
    return np.array([chr(c).lower() != chr(c) for c in range(_CASE_TABLE_SIZE)], dtype=bool)


def _lower_encoded(texts: Sequence[str]) -> list[bytes]:
    """Each text as UTF-8 (surrogates passed through), as `text.lower()` would encode except for ASCII A-Z, which
    the byte table of `_word_hashes` lower-cases in one pass over the batch.

    `str.lower` costs some 6 ns a character on non-ASCII text, about 5x the encoding, yet most non-ASCII text
    (curly quotes, dashes, accented lower-case letters) has no character it changes besides ASCII. So non-ASCII
    texts are encoded as they are; their characters are decoded in numpy from the lead bytes and looked up in
    `_lower_changes`; only a text holding one (an upper-case 'É', 'Σ' whose lower case depends on its context,
    the Kelvin sign that lowers to ASCII 'k') is lowered by `str.lower` first. For every other text `lower` changes
    ASCII letters only, so the result is the same bytes. The same look-up (`text_units.unspaced_table`) finds the
    texts holding a character of a script written without spaces: only those are rewritten with each such
    character a word of its own (`text_units.shingle_text`)."""
    encoded = [t.encode("ascii") if t.isascii() else t.encode("utf-8", "surrogatepass") for t in texts]
    wide = [k for k, t in enumerate(texts) if not t.isascii()]
    if not wide:
        return encoded
    joined = b"".join([encoded[k] for k in wide])
    data = np.frombuffer(joined + bytes(3), dtype=np.uint8)
    lead = np.flatnonzero(data[:len(joined)] >= 0xC0)  # the first byte of every character of 2-4 bytes
    b0 = data[lead].astype(np.int64)
    b1, b2, b3 = ((data[lead + i] & 0x3F).astype(np.int64) for i in (1, 2, 3))
    cp = np.where(b0 < 0xE0, ((b0 & 0x1F) << 6) | b1,
                  np.where(b0 < 0xF0, ((b0 & 0x0F) << 12) | (b1 << 6) | b2,
                           ((b0 & 0x07) << 18) | (b1 << 12) | (b2 << 6) | b3))
    changes = _lower_changes()
    cased = lead[(cp >= _CASE_TABLE_SIZE) | changes[np.minimum(cp, _CASE_TABLE_SIZE - 1)]]
    unspaced = unspaced_table()
    split = lead[unspaced[np.minimum(cp, len(unspaced) - 1)]]
    if len(cased) or len(split):
        ends = np.cumsum([len(encoded[k]) for k in wide])
        lowered = set(np.searchsorted(ends, cased, side="right").tolist())
        spaced = set(np.searchsorted(ends, split, side="right").tolist())
        for d in sorted(lowered | spaced):
            k = wide[d]
            text = shingle_text(texts[k]) if d in spaced else texts[k]
            encoded[k] = (text.lower() if d in lowered else text).encode("utf-8", "surrogatepass")
    return encoded


def _word_hashes(encoded: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    # A non-word byte before and after every text; lower-cased, non-word bytes 0; 8 more zeros so that an
    # 8-byte window can start at any byte.
    buf = b"\x00".join([b"", *encoded, bytes(8)]).translate(_LOWER_WORD_TABLE)
    n = len(buf) - 8
    data = np.frombuffer(buf, dtype=np.uint8, count=n)
    is_word = data != 0
    # Word k spans data[bounds[2k] + 1 : bounds[2k + 1] + 1].
    bounds = np.flatnonzero(is_word[1:] ^ is_word[:-1])
    before = bounds[0::2]  # the non-word byte before each word
    lens = bounds[1::2] - before
    # windows[i] = data[i + 1 : i + 9] as one little-endian integer (one byte on, so no before + 1 array): a
    # word's chunk j is windows[before + 8j], cut to the word's bytes.
    windows = np.ndarray(shape=(n,), dtype="<u8", buffer=buf, offset=1, strides=(1,))
    raw = windows[before]
    raw &= _CHUNK_MASK[np.minimum(lens, 8)]
    many = np.flatnonzero(lens > 8)
    if len(many):  # words of more than 8 bytes: every further chunk j times P^j, summed per word
        second = windows[before[many] + 8]  # chunk 1 of each (most long words have two): one gather
        second &= _CHUNK_MASK[np.minimum(lens[many] - 8, 8)]
        with np.errstate(over="ignore"):
            second *= np.uint64(_P)
            raw[many] += second
        longer = many[lens[many] > 16]
        if len(longer):  # chunks 2 and on
            extra = (lens[longer] + 7) // 8 - 2
            word = np.repeat(longer, extra)
            first = np.zeros(len(longer), dtype=np.int64)
            np.cumsum(extra[:-1], out=first[1:])
            j = np.arange(len(word), dtype=np.int64) - np.repeat(first - 2, extra)
            chunk = windows[before[word] + 8 * j]
            chunk &= _CHUNK_MASK[np.minimum(lens[word] - 8 * j, 8)]
            with np.errstate(over="ignore"):
                chunk *= _POWERS.get(int(j.max()) + 1)[j]
                raw[longer] += np.add.reduceat(chunk, first)
    with np.errstate(over="ignore"):
        raw += lens.view(np.uint64)
    doc_starts = np.zeros(len(encoded) + 1, dtype=np.int64)  # the separator before each text, as bounds count
    np.cumsum([len(e) + 1 for e in encoded], out=doc_starts[1:])
    first_word = np.searchsorted(before, doc_starts)
    return mix64(raw), first_word


@functools.lru_cache(maxsize=8)
def _shingle_offset(ngram: int) -> np.uint64:
    """sum((r + 1) M^(ngram-1-r), r < ngram) mod 2^64: the word positions' share of every full shingle's hash."""
    c = 0
    for r in range(ngram):
        c = (c * int(_SHINGLE_MULT) + r + 1) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(c)


def shingle_hashes(texts: Sequence[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """All shingle hashes of a batch of documents, concatenated, and each document's start offset.

    A document with fewer than `ngram` words has one shingle (all its words); an empty one has a single
    shingle of value 0, so every document has a signature. Shingle (w_0 .. w_n-1) hashes to
    h = (...((w_0 + 1) M + w_1 + 2) M ...) M + w_n-1 + n, then h ^ (h >> 29), a missing word adding 0.
    """
    wh, wstart = word_hashes(texts)
    lens = np.diff(wstart)
    n_sh = np.maximum(lens - ngram + 1, 1)
    sstart = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(n_sh, out=sstart[1:])
    # Full windows: one multiply-add per word over the whole batch (contiguous slices, no gathers); a window
    # starting in the last ngram - 1 words of a document runs into the next one and is dropped.
    # The constants fold into one add: h = sum(w_r M^(n-1-r)) + sum((r + 1) M^(n-1-r)) mod 2^64.
    n_win = max(0, len(wh) - ngram + 1)
    with np.errstate(over="ignore"):
        h = wh[:n_win] * _SHINGLE_MULT if ngram > 1 else wh[:n_win].copy()
        for r in range(1, ngram):
            h += wh[r:r + n_win]
            if r < ngram - 1:
                h *= _SHINGLE_MULT
        h += _shingle_offset(ngram)
    valid = np.ones(n_win, dtype=bool)
    for r in range(1, ngram):
        tail = wstart[1:] - r  # a start r words before a document's end
        valid[tail[(tail >= wstart[:-1]) & (tail < n_win)]] = False
    short = np.flatnonzero(lens < ngram)
    if len(short):  # one clipped shingle each: the words it has, then zeros
        out = np.empty(sstart[-1], dtype=np.uint64)
        full = np.ones(sstart[-1], dtype=bool)
        full[sstart[short]] = False
        out[full] = h[valid]
        hs = np.zeros(len(short), dtype=np.uint64)
        padded = np.concatenate([wh, np.zeros(ngram, dtype=np.uint64)])
        with np.errstate(over="ignore"):
            for r in range(ngram):
                hs = hs * _SHINGLE_MULT + np.where(r < lens[short], padded[wstart[short] + r] + np.uint64(r + 1),
                                                   np.uint64(0))
        out[sstart[short]] = hs
        h = out
    else:
        h = h[valid]
    h ^= h >> np.uint64(29)
    return h, sstart


def sorted_distinct(a: np.ndarray) -> np.ndarray:
    """`np.unique(a)` of a 1-D array by one sort and a compare. numpy 2.4's `np.unique` hashes integers first and
    costs several times a sort on large inputs (430-590 ns an element against 70 at 10^7-2 x 10^7 int64 here),
    and on arrays of a few hundred its per-call overhead dominates."""
    s = np.sort(a)
    distinct = np.empty(len(s), dtype=bool)
    distinct[:1] = True
    np.not_equal(s[1:], s[:-1], out=distinct[1:])
    return s[distinct]
