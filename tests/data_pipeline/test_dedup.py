"""Exact and near dedup: priorities, golden MinHash behaviour, and recall/precision on generated near-duplicates."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from bench.dedup_eval import (
    DedupBenchmark,
    make_benchmark,
    precision_by_origin,
    recall_precision,
    removal_recall,
    removed_precision,
    same_cluster_recall,
    split_pairs,
    true_jaccard,
)
from data_pipeline.build.dedup import NearDedupResult, assign_removals, exact_keep, near_dedup
from data_pipeline.build.minhash import MinHashConfig, band_keys, candidate_pairs, flat_keys, group_pairs, signatures
from data_pipeline.build.shingles import shingle_hashes, word_hashes
from data_pipeline.text_units import shingle_text


def test_exact_keeps_the_higher_priority_copy() -> None:
    hashes = np.array([5, 7, 5, 9, 7, 5], dtype=np.uint64)
    assert exact_keep(hashes).tolist() == [True, True, False, True, False, False]
    priority = np.array([0, 0, 0, 0, 3, 1])
    assert exact_keep(hashes, priority).tolist() == [False, False, False, True, True, True]


@pytest.mark.parametrize("scheme", ["oph", "kperm"])
def test_signature_agreement_estimates_jaccard(scheme: str) -> None:
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(5000)]
    base = list(rng.choice(vocab, 400))
    cfg = MinHashConfig(scheme=scheme)  # type: ignore[arg-type]
    for n_edit in (20, 60, 120):
        other = list(base)
        for i in rng.choice(len(base), n_edit, replace=False):
            other[i] = "zz" + other[i]
        a, b = " ".join(base), " ".join(other)
        sig = signatures([a, b], cfg)
        est, true = (sig[0] == sig[1]).mean(), true_jaccard(a, b)
        assert abs(est - true) < 4 * np.sqrt(true * (1 - true) / cfg.num_perm) + 0.01, (est, true)


def test_one_permutation_hashing_is_unbiased_where_most_bins_are_borrowed() -> None:
    """Documents of 20-60 shingles leave most of the 100 bins empty; densification must keep agreement an unbiased
    estimate of Jaccard (Shrivastava 2017), equal sets must give equal signatures, and a document's signature
    must not depend on the batch it is hashed in (the build's task count)."""
    rng = np.random.default_rng(1)
    texts, truth = [], []
    for _ in range(300):
        words = [f"t{x}" for x in rng.integers(0, 10**6, int(rng.integers(24, 64)))]
        other = list(words)
        for i in rng.choice(len(words), int(rng.integers(1, len(words) // 3)), replace=False):
            other[i] = "zz" + other[i]
        texts += [" ".join(words), " ".join(other)]
        truth.append(true_jaccard(texts[-2], texts[-1]))
    sig = signatures(texts, MinHashConfig())
    agree = (sig[0::2] == sig[1::2]).mean(axis=1)
    assert abs(agree.mean() - np.mean(truth)) < 0.01, (agree.mean(), np.mean(truth))  # 300 pairs: sd ~0.003
    assert np.corrcoef(agree, truth)[0, 1] > 0.9
    for k in (0, 7, 301):
        assert (signatures([texts[k]], MinHashConfig())[0] == sig[k]).all()
    one = signatures(["a b c d e", "a b c d e a b c d e", "x"], MinHashConfig())
    assert (one[0] != one[1]).any() and len(set(one[2].tolist())) == 1  # one shingle: every bin borrows it


def test_shingles_are_word_5grams_and_order_sensitive() -> None:
    h, off = shingle_hashes(["a b c d e f", "B, c; d e f.", "", "x y"], 5)
    assert off.tolist() == [0, 2, 3, 4, 5]  # 2 shingles, 1, 1 (empty doc), 1 (short doc)
    assert h[1] == h[2]  # "b c d e f" in both documents (case and punctuation are not words)
    h2, _ = shingle_hashes(["f e d c b a"], 5)
    assert not set(h2.tolist()) & set(h[:2].tolist())


def test_word_hashes_match_regex_words() -> None:
    texts = ["Hello, world! x_1 = café(2)", "", "  ", "naïve--Ünïcode words_here"]
    wh, first = word_hashes(texts)
    words = [re.findall(r"\w+", t.lower()) for t in texts]
    assert np.diff(first).tolist() == [len(w) for w in words]
    flat = [w for ws in words for w in ws]
    for i, j in [(a, b) for a in range(len(flat)) for b in range(len(flat))]:
        assert (wh[i] == wh[j]) == (flat[i] == flat[j])


def test_word_hashes_are_the_polynomial_hash_of_python_lowered_words_in_any_batch() -> None:
    import data_pipeline.build.shingles as mh

    # ASCII documents are lower-cased by the byte table, the others by str.lower: both must give Python's words.
    texts = ["Hello, WORLD_2 x\x00Y", "", "ΟΔΟΣ Σ ΣΑ aΣ", "İstanbul KELVIN \u212a ǅ ß ẞ", "A\ud800B café",
             "  --  ", "ÀÉÎ plain ASCII", "MiXeD ascii ONLY", "\U00010400\U00010428 x",
             # words of 7, 8, 9, 16, 17 and 40 bytes: one chunk, a full one, the chunk after, and many
             "abcdefg abcdefgh abcdefghi abcdefghijklmnop abcdefghijklmnopq " + "ab_" * 13 + "z",
             # non-ASCII with nothing `lower` changes but ASCII (encoded as is), and with one change at the very end
             "Café “Quoted” — naïve 中文 😀 Ünchanged", "Ende ÜBER", "emoji 😀 then Ω", "x \U0001e900"]
    # Random texts over characters lower leaves alone, changes, changes by context or to ASCII, of 1-4 bytes.
    pool = list("aZ _-.") + list("éüñ’—“中😀\u00a0") + list("ÉÜΣΩЖİ\u212aǅ\U00010400\U0001e900")
    rng = np.random.default_rng(3)
    texts += ["".join(rng.choice(pool, size=int(rng.integers(1, 30)))) for _ in range(300)]

    def reference(text: str) -> list[int]:  # each character of an unspaced script a word (test_text_units)
        data = shingle_text(text).lower().encode("utf-8", "surrogatepass")
        words = re.findall(rb"[0-9a-z_\x80-\xff]+", data)
        chunks = [[int.from_bytes(w[i:i + 8], "little") for i in range(0, len(w), 8)] for w in words]
        raw = [(sum(c * pow(mh._P, j, 1 << 64) for j, c in enumerate(cs)) + len(w)) % (1 << 64)
               for w, cs in zip(words, chunks, strict=True)]
        return mh.mix64(np.array(raw, dtype=np.uint64)).tolist()

    want = [reference(t) for t in texts]
    for batch in (texts, texts[::-1], [texts[2], texts[7]], [texts[7]], [texts[3]], texts[10:12], []):
        wh, first = word_hashes(batch)
        assert [wh[first[k]:first[k + 1]].tolist() for k in range(len(batch))] == [want[texts.index(t)] for t in batch]
    assert word_hashes([])[1].tolist() == [0] and shingle_hashes([], 5)[1].tolist() == [0]


def test_word_hashes_split_into_bounded_batches_give_the_same_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    import data_pipeline.build.shingles as mh

    rng = np.random.default_rng(0)
    vocab = ["alpha", "Beta", "café", "x_1", "naïve", "über", "42", "--", "\n", "   "]
    texts = ["".join(rng.choice(vocab, size=int(rng.integers(0, 60))) + " ") for _ in range(300)] + ["", "one"]
    whole_h, whole_first = word_hashes(texts)
    whole_sh, whole_off = shingle_hashes(texts, 5)
    monkeypatch.setattr(mh, "WORD_BATCH_BYTES", 256)  # most documents alone in a batch, some several together
    monkeypatch.setattr(mh, "_POWERS", mh._Powers())
    h, first = word_hashes(texts)
    assert np.array_equal(h, whole_h) and np.array_equal(first, whole_first)
    sh, off = shingle_hashes(texts, 5)
    assert np.array_equal(sh, whole_sh) and np.array_equal(off, whole_off)
    assert len(mh._POWERS.pos) <= 2 * (max(len(t.encode()) for t in texts) // 8 + 1)  # the longest word's chunks


def test_bands_and_probe_find_one_row_differences() -> None:
    sig = np.arange(3 * 112, dtype=np.uint32).reshape(3, 112)
    sig[1] = sig[0]
    sig[1, ::8] += 1000  # row 0 of every band differs: no full band agrees
    sig[2, :] += 5000
    assert len(candidate_pairs(band_keys(sig, 14, 8))) == 0
    assert candidate_pairs(band_keys(sig, 14, 8, probe=True)).tolist() == [[0, 1]]


def test_default_banding_meets_pairs_on_the_curve_it_claims() -> None:
    """The default (20 bands x 5 rows, no probe) finds a pair of Jaccard J with probability 1 - (1 - J^5)^20 —
    measured end to end (words, shingles, one permutation hashing, band keys, pairs) on 1,200 pairs of real
    Jaccard 0.3-0.97 — and so nearly every pair at J >= 0.8, as one-row multi-probe over 14 x 8 did with 112
    keys a document."""
    cfg = MinHashConfig()
    assert (cfg.bands, cfg.rows, cfg.probe) == (20, 5, False)
    rng = np.random.default_rng(5)
    texts, truth = [], []
    for _ in range(1200):
        words = [f"w{x}" for x in rng.integers(0, 10**7, 300)]
        other = list(words)
        for i in rng.choice(300, int(rng.integers(2, 40)), replace=False):
            other[i] = "zz" + other[i]
        texts += [" ".join(words), " ".join(other)]
        truth.append(true_jaccard(texts[-2], texts[-1]))
    found = {tuple(p) for p in candidate_pairs(band_keys(signatures(texts, cfg), cfg.bands, cfg.rows)).tolist()}
    hit = np.array([(2 * k, 2 * k + 1) in found for k in range(len(truth))])
    j = np.array(truth)
    assert j.min() < 0.4 and j.max() > 0.9
    for lo, hi in ((0.3, 0.5), (0.5, 0.65), (0.65, 0.8), (0.8, 1.0)):
        sel = (j >= lo) & (j < hi)
        expect = (1 - (1 - j[sel] ** 5) ** 20).mean()
        tolerance = 4 * np.sqrt(expect * (1 - expect) / sel.sum()) + 0.02
        assert sel.sum() >= 50 and abs(hit[sel].mean() - expect) < tolerance, (lo, hi, hit[sel].mean(), expect)
    assert hit[j >= 0.8].mean() >= 0.995


def _reference_pairs(keys: list[int], ids: list[int], small_group: int) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for k, i in zip(keys, ids, strict=True):
        groups.setdefault(k, []).append(i)
    out = set()
    for members in groups.values():
        if len(members) <= small_group:
            out |= {(min(a, b), max(a, b)) for x, a in enumerate(members) for b in members[x + 1:]}
        else:
            lo = min(members)
            out |= {(lo, b) for b in members}
    return sorted([a, b] for a, b in out if a != b)


@pytest.mark.parametrize("kind", ["few_values", "low_bits_only", "high_bits_only", "random_with_repeats",
                                  "one_huge_group"])
def test_group_pairs_matches_a_dictionary_of_buckets(kind: str) -> None:
    """group_pairs finds repeated keys by a counting filter on the low bits (above FILTER_MIN keys), a value sort
    on the high bits (positions packed in the low bits), then an exact argsort: keys equal only in their high or
    only in their low bits must not meet, big groups pair with their smallest id."""
    rng = np.random.default_rng(7)
    for it in range(25):
        m = int(rng.integers(2, 2000)) if it % 4 else int(rng.integers(4096, 12_000))  # the counting filter too
        if kind == "few_values":
            keys = rng.integers(0, 40, size=m).astype(np.uint64)
        elif kind == "low_bits_only":  # same high bits, different low bits: colliding in the packed sort
            keys = (rng.integers(0, 8, size=m).astype(np.uint64) << np.uint64(40)) | rng.integers(0, 3, size=m).astype(
                np.uint64)
        elif kind == "high_bits_only":  # same low 24 bits, different high bits: colliding in the counting filter
            keys = (rng.integers(0, m // 3 + 2, size=m).astype(np.uint64) << np.uint64(24)) | np.uint64(5)
        elif kind == "random_with_repeats":
            keys = rng.integers(0, 2**63, size=m, dtype=np.int64).astype(np.uint64) << np.uint64(1)
            keys[rng.integers(0, m, size=m // 4)] = keys[rng.integers(0, m, size=m // 4)]
        else:
            keys = np.full(m, np.uint64(2**64 - 1))
            keys[::5] = np.uint64(3)
        ids = rng.integers(0, m // 2 + 1, size=m)
        small = int(rng.integers(2, 10))
        assert group_pairs(keys, ids, small).tolist() == _reference_pairs(keys.tolist(), ids.tolist(), small)


def test_candidate_pairs_split_into_key_ranges_give_the_pairs_of_one_array() -> None:
    """Above `range_keys` keys, candidate_pairs groups key ranges block by block: the pairs of one group_pairs
    call over all keys, big groups (paired with their smallest id) and keys repeated within a document included."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        n, cols = int(rng.integers(1, 1500)), int(rng.integers(1, 16))
        keys = rng.integers(0, int(rng.choice([4, 60, 1 << 62])), size=(n, cols), dtype=np.int64).astype(np.uint64)
        whole = group_pairs(flat_keys(keys), np.repeat(np.arange(n), cols))
        for range_keys in (64, 700, 5000):  # 2 to 512 ranges (one per key would be minutes of Python)
            assert np.array_equal(candidate_pairs(keys, range_keys=range_keys), whole), (n, cols, range_keys)


def test_band_keys_in_blocks_are_the_keys_of_each_document_alone() -> None:
    rng = np.random.default_rng(4)
    sig = rng.integers(0, 1 << 32, size=(40_000, 16), dtype=np.uint32)  # three blocks of 2^14 documents
    for probe in (False, True):
        keys = band_keys(sig, 2, 8, probe)
        for k in (0, 16383, 16384, 39_999):
            assert np.array_equal(band_keys(sig[k:k + 1], 2, 8, probe)[0], keys[k])


def test_removal_never_goes_through_a_chain_and_names_its_kept_document() -> None:
    b, a = np.array([1, 2, 3, 3]), np.array([0, 1, 0, 2])  # 0~1, 1~2, 0~3, 2~3 (ranks; 0 and 2 unrelated)
    chosen, removed = assign_removals(b, a, 0, 4, lambda r: np.zeros(len(r), dtype=bool))
    assert removed.tolist() == [False, True, False, True]  # 2 is kept: its only better neighbour 1 was removed
    assert list(zip(b[chosen].tolist(), a[chosen].tolist(), strict=True)) == [(1, 0), (3, 0)]  # best-ranked kept
    # The same edges split over two rank ranges, [0, 2) decided first: the same answer.
    first = assign_removals(b[:1], a[:1], 0, 2, lambda r: np.zeros(len(r), dtype=bool))[1]
    chosen2, removed2 = assign_removals(b[1:], a[1:], 2, 4, lambda r: first[r])
    assert removed2.tolist() == [False, True] and (a[1:][chosen2] == 0).all()


def test_precision_is_split_by_what_the_removed_document_is() -> None:
    """A removed member of a natural known pair, a removed generated copy and a removed document in no known pair
    (filler) are told apart, each with its own precision on the truth's tokens."""
    rng = random.Random(3)
    words = [f"tok{i}" for i in range(3_000)]
    base = [" ".join(rng.choice(words) for _ in range(120)) for _ in range(3)]

    def edit(t: str, k: int) -> str:
        w = t.split()
        for i in rng.sample(range(len(w)), k):
            w[i] = "zz" + w[i]
        return " ".join(w)

    texts = [base[0], edit(base[0], 2), base[1], edit(base[1], 2), base[2], edit(base[2], 2)]
    bench = DedupBenchmark(texts, [(0, 1, true_jaccard(texts[0], texts[1])), (2, 3, true_jaccard(texts[2], texts[3]))],
                           ["natural", "generated"])
    result = near_dedup(texts, MinHashConfig())
    removed, good = removed_precision(bench, result)
    assert removed.tolist() == [1, 3, 5] and good.all()
    assert precision_by_origin(bench, removed, good) == {
        "generated copy": {"removed": 1, "precision@0.7": 1.0}, "natural": {"removed": 1, "precision@0.7": 1.0},
        "other": {"removed": 1, "precision@0.7": 1.0}}
    # With each document's group known, a removed document in no known pair is filler (no group) or a natural file.
    bench.groups = ["a", "a", "", "", "c", ""]
    assert set(precision_by_origin(bench, removed, good)) == {"generated copy", "natural", "filler"}
    bench.groups[5] = "c"
    assert set(precision_by_origin(bench, removed, good)) == {"generated copy", "natural", "natural, unpaired"}


def test_split_pairs_tell_a_chain_from_a_miss() -> None:
    """Known pairs of J >= 0.8 in two clusters, by cause: a chain (B removed for A, C kept, A and C below J 0.7 —
    one cluster would join them), two kept documents that are near each other themselves, and a pair left whole.
    Windows of one token sequence set the truth Jaccard: 100 tokens shifted by 10 share 86 of 106 shingles."""
    x, y, z = ([f"{p}{i}" for i in range(200)] for p in "xyz")
    texts = [" ".join(x[0:100]), " ".join(x[10:110]), " ".join(x[20:120]),  # A ~ B ~ C, A and C apart
             " ".join(z[0:100]), " ".join(z[5:105]),  # D ~ E, both kept
             " ".join(y[0:100]), " ".join(y[5:105]), " ".join(y[10:110])]  # F ~ G ~ H, F and H near too
    assert true_jaccard(texts[0], texts[1]) == pytest.approx(86 / 106) and true_jaccard(texts[0], texts[2]) < 0.7
    assert true_jaccard(texts[5], texts[7]) >= 0.8
    pairs = [(a, b, true_jaccard(texts[a], texts[b])) for a, b in ((0, 1), (1, 2), (3, 4), (6, 7))]
    bench = DedupBenchmark(texts, pairs, ["natural"] * 4)
    keep = np.array([True, False, True, True, True, True, False, True])
    result = NearDedupResult(keep=keep, cluster=np.array([0, 0, 2, 3, 4, 5, 5, 7]), candidates=0, verified=0)
    assert split_pairs(bench, result) == {"pairs": 4, "both kept": 1, "chain": 1, "near kept": 1}
    assert same_cluster_recall(bench, result) == 0.25 and removal_recall(bench, result) == 0.75


def test_recall_and_precision_on_generated_near_duplicates() -> None:
    bench = make_benchmark(n_base=500, n_copies=240, seed=4)
    js = np.array([j for _, _, j in bench.pairs])
    assert js.min() > 0.45 and js.max() < 0.97 and (js >= 0.8).sum() >= 60  # spread over 0.5-0.95
    result = near_dedup(bench.texts, MinHashConfig())
    recall, precision = recall_precision(bench, result)
    assert recall >= 0.98 and precision >= 0.95, (recall, precision)
    # Split by what the removed documents are: the parts add up to the whole.
    removed, good = removed_precision(bench, result)
    split = precision_by_origin(bench, removed, good)
    assert sum(v["removed"] for v in split.values()) == len(removed) == int((~result.keep).sum())
    assert sum(v["removed"] * v["precision@0.7"] for v in split.values()) == pytest.approx(precision * len(removed))
    assert list(split) == ["generated copy"] and split["generated copy"]["removed"] > 100  # the copies go
    report = result.report()
    assert report["removed"] == int((~result.keep).sum()) > 0 and report["largest"][0]["size"] >= 2
