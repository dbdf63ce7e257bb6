"""Near dedup, same work for every tool: Tessera's numpy MinHash LSH vs datasketch vs datatrove.

Same shingles: every tool hashes the same word 5-grams — lower-cased text, words = maximal runs of ASCII
letters, digits, '_' and non-ASCII UTF-8 bytes (Tessera's rule, `data_pipeline.build.shingles`), joined by a space.
datasketch gets them as bytes; datatrove gets the same splitter as its `WordTokenizer` and a `TextNormConfig`
with every normalisation off (so its own number/punctuation folding does not change the shingle sets). Same
banding for every tool in a row: 14 bands x 8 rows (FineWeb's, datatrove's default) for the plain rows, 20 x 5
(Tessera's default, made for verification) for the default rows; seed 1. Each tool keeps its own hash function
(datasketch: xxh32, faster than its sha1 default; datatrove: its xxhash64 default).

Rows, all in one process, one after another, on the same corpus:
  plain      : signatures + LSH + each tool's clustering, trusting the bands (the headline: plain vs plain).
               datasketch: `MinHash.bulk`, `MinHashLSH.insertion_session`, one `query` per document, then the
               same edge clustering as Tessera's (remove a document only next to a kept one, labelled with it).
               datatrove: its four stages (signature, buckets, cluster, filter) with the local executor.
  + verify   : the candidate pairs verified by exact Jaccard >= VERIFY (0.75, the default's threshold) on the
               tool's own shingle sets, then the same edge clustering; for peers a post-pass (its CPU time is also
               shown alone).
  default    : Tessera's default (20 x 5 + verification) against each peer run at 20 x 5 plus the same verify
               post-pass; and Tessera's previous default (14 x 8 with one-row multi-probe + verification:
               the same curve at 112 keys a document instead of 20) in the same run, skip with `probe`.
  kperm      : Tessera plain and default with scheme "kperm" (112 permutations, the signatures before one
               permutation hashing became the default), for the scheme's speed and accuracy in the same run.
docs/CPU-s: documents per CPU-second of the process (getrusage user + sys, children included), fair on a
shared machine; wall seconds beside it. Ground truth and metrics: `bench.dedup_eval` (truth Jaccard on
whitespace tokens with plain Python sets, independent of every tool's tokenizer). recall@0.8 is the dedup outcome,
"not both kept": a known pair of truth J >= 0.8 with at least one copy removed. "In one cluster" is printed beside
it, with why the pairs it misses are split (`dedup_eval.split_pairs`: two kept documents below J 0.7 of each other,
which one cluster would chain, or two kept documents of J >= 0.7 with no verified edge). A threshold sweep of the
default (`--sweep`) shows recall and precision at each verification threshold, from one set of verified candidate
pairs; `--png` plots it.

datatrove and datasketch are not Tessera dependencies; run with a separate environment:
    python3 -m venv /tmp/benchvenv
    /tmp/benchvenv/bin/pip install numpy "xxhash<4" datasketch datatrove regex tokenizers nltk matplotlib
    PYTHONPATH=. nice -n 19 /tmp/benchvenv/bin/python bench/dedup_vs_peers.py --docs 20000 --corpus code prose
    ... --docs 1000000 for the headline size (CPU-hours for datatrove; --skip datatrove leaves it out)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import re
import resource
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py`: bench.* from the root

from bench.dedup_eval import (
    CACHE_SETS,
    DedupBenchmark,
    jaccard_histogram,
    make_corpus,
    precision_by_origin,
    removal_recall,
    removed_precision,
    same_cluster_recall,
    set_jaccard,
    split_pairs,
    word_shingles,
)
from data_pipeline.build.dedup import NearDedupResult, assign_removals, verify_pairs
from data_pipeline.build.minhash import MinHashConfig, band_keys, candidate_pairs, signatures

BANDS, ROWS, SEED, NGRAM = 14, 8, 1, 5
_DEFAULT = MinHashConfig(seed=SEED)  # the shipped banding and verification threshold (the bench's seed)
assert _DEFAULT.verify_threshold is not None
VERIFY = _DEFAULT.verify_threshold
"""Every verified row and every peer's post-pass keeps the pairs of exact Jaccard >= this: the same work."""
PRECISION_AT = 0.7
"""The metric's threshold (pair precision@0.7), not a tool's: see `dedup_eval`."""
SWEEP = (0.70, 0.72, 0.75, 0.78, 0.80)
DEFAULT_BANDING = f"{_DEFAULT.bands}x{_DEFAULT.rows}"  # for row names
DEFAULT_ROW = f"tessera default ({DEFAULT_BANDING} + verify)"
PROBE_ROW = f"tessera {BANDS}x{ROWS} probe + verify"  # the default before it
_DRY_GROUPS = {"code": "code:json/", "prose": "prose:LICENSE"}
_BYTE_WORDS = re.compile(rb"[0-9A-Za-z_\x80-\xff]+")


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Stages:
    """CPU seconds per named stage (the profile of where a tool's time goes)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        c0 = cpu_seconds()
        yield
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu_seconds() - c0


def words(text: str) -> list[bytes]:
    """Tessera's words of `text` (see the module docstring), as bytes."""
    return _BYTE_WORDS.findall(text.lower().encode("utf-8", "surrogatepass"))


def shingles(text: str, n: int = NGRAM) -> list[bytes]:
    """The distinct word n-grams, space-joined; a shorter text is one shingle (all its words), as in Tessera."""
    w = words(text)
    return list({b" ".join(w[i:i + n]) for i in range(max(1, len(w) - n + 1))})


def cluster_edges(n: int, edges: np.ndarray, candidates: int) -> NearDedupResult:
    """The one edge clustering every row shares, Tessera's rule (`dedup.assign_removals`): in document order, a
    document is removed iff it has an edge to a kept earlier one, and labelled with that representative."""
    edges = np.sort(edges.reshape(-1, 2), axis=1)
    order = np.lexsort((edges[:, 0], edges[:, 1]))
    b, a = edges[order, 1], edges[order, 0]
    chosen, removed = assign_removals(b, a, 0, n, lambda r: np.zeros(len(r), dtype=bool))
    cluster = np.arange(n, dtype=np.int64)
    cluster[b[chosen]] = a[chosen]
    return NearDedupResult(keep=~removed, cluster=cluster, candidates=candidates, verified=len(edges))


def verify(pairs: np.ndarray, shingles_of: Callable[[int], Sequence[bytes]]) -> np.ndarray:
    """The post-pass offered to each peer: the pairs whose exact Jaccard of shingle sets is >= VERIFY."""
    sets: dict[int, frozenset[bytes]] = {}
    for i in np.unique(pairs).tolist():
        sets[i] = frozenset(shingles_of(i))
    ok = []
    for i, j in pairs.tolist():
        a, b = sets[i], sets[j]
        inter = len(a & b)
        ok.append(inter >= VERIFY * (len(a) + len(b) - inter))
    return pairs[np.asarray(ok, dtype=bool)].reshape(-1, 2)


def shared_precision(texts: Sequence[str], result: NearDedupResult) -> float:
    """Pair precision@0.7 in the tools' own shingles (exact, Python sets): what is left of the truth's figure
    once the tokenizers' disagreement near 0.7 is taken out — LSH and clustering error alone."""
    removed = np.flatnonzero(~result.keep)
    if not len(removed):
        return 1.0
    cache: dict[int, frozenset[bytes]] = {}

    def sh(i: int) -> frozenset[bytes]:
        if i not in cache:
            if len(cache) >= CACHE_SETS:
                cache.clear()
            cache[i] = frozenset(shingles(texts[i]))
        return cache[i]

    order = np.argsort(result.cluster, kind="stable")
    labels = result.cluster[order]
    good = 0
    for r in removed.tolist():
        lo, hi = np.searchsorted(labels, result.cluster[r]), np.searchsorted(labels, result.cluster[r], "right")
        for k in order[lo:hi].tolist():
            if result.keep[k]:
                inter = len(sh(r) & sh(k))
                if inter >= PRECISION_AT * (len(sh(r)) + len(sh(k)) - inter):
                    good += 1
                    break
    return good / len(removed)


def as_pairs(pairs: list[tuple[int, int]] | np.ndarray) -> np.ndarray:
    arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    return np.unique(np.sort(arr, axis=1), axis=0) if len(arr) else arr


# ---------------------------------------------------------------------------------------------- Tessera


def scored_candidates(texts: list[str], cfg: MinHashConfig, st: Stages) -> tuple[np.ndarray, np.ndarray | None]:
    """near_dedup's steps up to verification, one by one (same calls), so the profile shows each: the candidate
    pairs and, when `cfg` verifies, their exact shingle Jaccard."""
    kept: list[np.ndarray] = []
    with st("shingles + signatures"):
        sig = signatures(texts, cfg, keep_shingles=kept if cfg.verify_threshold is not None else None)
    with st("band keys + candidate pairs"):
        pairs = candidate_pairs(band_keys(sig, cfg.bands, cfg.rows, cfg.probe))
    if cfg.verify_threshold is None:
        return pairs, None
    with st("verification"):
        return pairs, (verify_pairs(pairs, lambda ids: [kept[i] for i in ids]) if len(pairs) else np.zeros(0))


def run_tessera(texts: list[str], cfg: MinHashConfig, st: Stages) -> NearDedupResult:
    """near_dedup end to end, its steps timed one by one."""
    pairs, sims = scored_candidates(texts, cfg, st)
    with st("clustering"):
        return cluster_edges(len(texts), pairs if sims is None else pairs[sims >= cfg.verify_threshold], len(pairs))


def threshold_sweep(bench: DedupBenchmark, thresholds: Sequence[float] = SWEEP) -> dict[str, Any]:
    """Accuracy of Tessera's default banding at each verification threshold, from one set of verified candidate
    pairs (untimed). The metrics put the negatives below truth J 0.7 (precision) and the positives at 0.8 and above
    (recall); a tool whose shingles are not the truth's should sit inside that margin, and this shows where.

    Also the calibration the choice rests on: for the known pairs with truth J in 0.6-0.8 (the margin and the hard
    negatives below it), how far the shingles every tool hashes (lower-cased words, `dedup_eval.word_shingles`,
    plain Python sets) put them from the truth's whitespace tokens."""
    texts = bench.texts
    pairs, sims = scored_candidates(texts, _DEFAULT, Stages())
    assert sims is not None
    rows: dict[str, Any] = {}
    for t in thresholds:
        result = cluster_edges(len(texts), pairs[sims >= t], len(pairs))
        removed, good = removed_precision(bench, result)
        rows[f"{t:.2f}"] = {"recall@0.8": same_cluster_recall(bench, result),
                            "removal_recall@0.8": removal_recall(bench, result),
                            "pair_precision@0.7": float(good.mean()) if len(good) else 0.0,
                            "pair_precision@0.7_by_origin": precision_by_origin(bench, removed, good),
                            "removed": len(removed), "split_pairs@0.8": split_pairs(bench, result)}
    gaps: dict[str, list[float]] = {}
    for (a, b, j), origin in zip(bench.pairs, bench.origin or ["generated"] * len(bench.pairs), strict=True):
        if 0.6 <= j < 0.8:
            gaps.setdefault(origin, []).append(set_jaccard(word_shingles(texts[a]), word_shingles(texts[b])) - j)
    calibration = {o: {"pairs": len(g), "median": float(np.median(g)), "p10": float(np.percentile(g, 10)),
                       "p90": float(np.percentile(g, 90))} for o, g in sorted(gaps.items())}
    print(f"  threshold sweep, {DEFAULT_BANDING} + verify at t (recall@0.8 in one cluster / not both kept, "
          "pair precision@0.7 on truth tokens):")
    for t, r in rows.items():
        sp = r["split_pairs@0.8"]
        print(f"    t={t}: {r['recall@0.8']:.3f} / {r['removal_recall@0.8']:.3f}, "
              f"precision {r['pair_precision@0.7']:.3f} (" + ", ".join(
                  f"{k} {v['precision@0.7']:.3f} of {v['removed']}"
                  for k, v in r["pair_precision@0.7_by_origin"].items()) + ")"
              f"; split pairs: both kept {sp['both kept']}, chain {sp['chain']}, near kept {sp['near kept']}",
              flush=True)
    print("  words J - truth J on known pairs of truth J 0.6-0.8: " + ", ".join(
        f"{o} median {c['median']:+.3f} (p10 {c['p10']:+.3f}, p90 {c['p90']:+.3f}; {c['pairs']} pairs)"
        for o, c in calibration.items()), flush=True)
    return {"thresholds": rows, "words_minus_truth_J_0.6-0.8": calibration}


def plot_sweeps(sweeps: dict[str, dict[str, Any]], png: str) -> None:
    """Recall and precision against the verification threshold, one panel per corpus, the goals drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 4.2), squeeze=False)
    for ax, (kind, sweep) in zip(axes[0], sweeps.items(), strict=True):
        ts = [float(t) for t in sweep["thresholds"]]
        rows = list(sweep["thresholds"].values())
        ax.plot(ts, [r["removal_recall@0.8"] for r in rows], "o-", label="recall@0.8 (not both kept)")
        ax.plot(ts, [r["recall@0.8"] for r in rows], "o--", label="recall@0.8 (in one cluster)")
        ax.plot(ts, [r["pair_precision@0.7"] for r in rows], "s-", label="pair precision@0.7")
        for origin in sorted({o for r in rows for o in r["pair_precision@0.7_by_origin"]}):
            ax.plot(ts, [r["pair_precision@0.7_by_origin"].get(origin, {}).get("precision@0.7", np.nan)
                         for r in rows], ":", lw=1, label=f"  precision, {origin}")
        ax.axhline(0.98, color="grey", lw=0.6)
        ax.axhline(0.95, color="grey", lw=0.6, ls="--")
        ax.axvline(VERIFY, color="black", lw=0.6)
        ax.set_title(f"{kind}: {DEFAULT_BANDING} + verify, truth on whitespace tokens", fontsize=9)
        ax.set_xlabel("verification threshold (Jaccard of Tessera's word 5-grams)")
        ax.set_ylim(0.8, 1.005)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ---------------------------------------------------------------------------------------------- datasketch


def datasketch_pairs(texts: list[str], st: Stages, bands: int = BANDS, rows: int = ROWS,
                     batch: int = 10_000) -> np.ndarray:
    """datasketch's bulk API in batches of `batch` documents: shingles, `MinHash.bulk`, insertion; the
    shingle lists are dropped after each batch (kept whole they need ~40 GB at 10^6 prose documents), so the
    verify post-pass shingles the documents it reads again, as it does for datatrove."""
    import xxhash
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=bands * rows, params=(bands, rows))
    mhs: list[Any] = []
    with lsh.insertion_session() as session:
        for lo in range(0, len(texts), batch):
            with st("shingles"):
                sh = [shingles(t) for t in texts[lo:lo + batch]]
            with st("MinHash.bulk"):
                part = MinHash.bulk(sh, num_perm=bands * rows, seed=SEED, hashfunc=xxhash.xxh32_intdigest)
            del sh
            with st("LSH insertion session"):
                for i, m in enumerate(part, start=lo):
                    session.insert(i, m, check_duplication=False)
            mhs.extend(part)
    with st("LSH query"):
        found = [(i, j) for i, m in enumerate(mhs) for j in lsh.query(m) if j != i]
    return as_pairs(found)


def run_datasketch(texts: list[str], st: Stages, bands: int = BANDS,
                   rows: int = ROWS) -> tuple[NearDedupResult, np.ndarray]:
    pairs = datasketch_pairs(texts, st, bands, rows)
    with st("clustering"):
        return cluster_edges(len(texts), pairs, len(pairs)), pairs


# ---------------------------------------------------------------------------------------------- datatrove


def run_datatrove(texts: list[str], st: Stages, bands: int = BANDS,
                  rows: int = ROWS) -> tuple[NearDedupResult, np.ndarray]:
    """datatrove's four MinHash stages with the local executor; also returns the candidate pairs (.dups)."""
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.utils.text import TextNormConfig
    from datatrove.utils.word_tokenizers import WordTokenizer
    from loguru import logger

    logger.remove()  # its per-stage console log; the executor still writes its log files (counted)

    class SameWords(WordTokenizer):
        """Tessera's word splitter, so datatrove hashes the same shingles."""

        def __init__(self) -> None:
            super().__init__("en")

        def word_tokenize(self, text: str) -> list[str]:
            return [w.decode("utf-8", "surrogatepass") for w in words(text)]

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    off = TextNormConfig(lowercase=False, norm_whitespace=False, remove_punctuation=False,
                         norm_unicode_diacritics=False, norm_numbers=False, norm_weekdays=False,
                         norm_monthnames=False)
    cfg = MinhashConfig(n_grams=NGRAM, num_buckets=bands, hashes_per_bucket=rows, seed=SEED, norm_config=off)
    kept: list[int] = []

    def reader(data: Any, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        # A function step: the executor deep-copies its pipeline per task, and a function is copied by reference.
        yield from (Document(text=t, id=str(i)) for i, t in enumerate(texts))

    def collect(data: Any, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        for doc in data:
            kept.append(int(doc.id))
            yield doc

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        stages: list[tuple[str, list[Any], int]] = [
            ("signature", [reader, MinhashDedupSignature(output_folder=str(root / "sigs"), config=cfg,
                                                         language=SameWords())], 1),
            ("buckets", [MinhashDedupBuckets(input_folder=str(root / "sigs"), output_folder=str(root / "buckets"),
                                             config=cfg)], bands),
            ("cluster", [MinhashDedupCluster(input_folder=str(root / "buckets"), output_folder=str(root / "remove"),
                                             config=cfg, save_cluster_id=True)], 1),
            ("filter", [reader, MinhashDedupFilter(input_folder=str(root / "remove")), collect], 1),
        ]
        for k, (name, pipeline, tasks) in enumerate(stages):
            with st(name):
                LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1,
                                      logging_dir=str(root / f"logs{k}")).run()
        cluster = np.arange(len(texts))
        clusters_file = root / "remove" / "000000.clusters"
        if clusters_file.is_file():
            for idx, cid in struct.iter_unpack("<2I", clusters_file.read_bytes()):
                cluster[idx] = len(texts) + cid
        sentinel = (1 << 32) - 1
        found = [(d1, d2) for f in sorted((root / "buckets").glob("*.dups"))
                 for f1, d1, _, d2 in struct.iter_unpack("<4I", f.read_bytes()) if f1 != sentinel]
    keep = np.zeros(len(texts), dtype=bool)
    keep[kept] = True
    return NearDedupResult(keep=keep, cluster=cluster, candidates=len(found), verified=0), as_pairs(found)


# ---------------------------------------------------------------------------------------------- driver


def measure(rows: dict[str, dict[str, Any]], name: str, bench: DedupBenchmark,
            fn: Callable[[Stages], NearDedupResult]) -> None:
    st = Stages()
    c0, t0 = cpu_seconds(), time.perf_counter()
    result = fn(st)
    cpu, wall = cpu_seconds() - c0, time.perf_counter() - t0
    recall = same_cluster_recall(bench, result)
    removed, good = removed_precision(bench, result)
    precision = float(good.mean()) if len(good) else 0.0
    by_origin = precision_by_origin(bench, removed, good)
    shared = shared_precision(bench.texts, result)
    n = len(bench.texts)
    rows[name] = {"docs_per_cpu_s": n / cpu, "cpu_s": cpu, "wall_s": wall, "recall@0.8": recall,
                  "removal_recall@0.8": removal_recall(bench, result),
                  "pair_precision@0.7": precision, "pair_precision@0.7_by_origin": by_origin,
                  "shared_shingle_precision@0.7": shared,
                  "removed": int((~result.keep).sum()),
                  "candidates": result.candidates, "stages_cpu_s": {k: round(v, 2) for k, v in st.cpu.items()}}
    split = split_pairs(bench, result)
    rows[name]["split_pairs@0.8"] = split
    n_split = split["both kept"] + split["chain"] + split["near kept"]
    print(f"  {name:38s} {n / cpu:9.0f} docs/CPU-s (cpu {cpu:7.1f} s, wall {wall:7.1f} s)"
          f"  recall@0.8 {rows[name]['removal_recall@0.8']:.3f} (in one cluster {recall:.3f})"
          f"  pair-precision@0.7 {precision:.3f} (shared shingles {shared:.3f})  removed {rows[name]['removed']}"
          f"  candidates {result.candidates}"
          f"\n  {'':38s} precision@0.7 by removed document: " + ", ".join(
              f"{k} {v['precision@0.7']:.3f} ({v['removed']})" for k, v in by_origin.items()) +
          f"\n  {'':38s} pairs of J >= 0.8 in two clusters: {n_split} of "
          f"{split['pairs']} (both kept {split['both kept']}, kept documents below J 0.7 of each other "
          f"{split['chain']}, of J >= 0.7 {split['near kept']})"
          f"\n  {'':38s} stages (CPU s): " + ", ".join(f"{k} {v:.2f}" for k, v in st.cpu.items()), flush=True)


def warm_up(texts: list[str], skip: set[str]) -> None:
    """Every tool once on a few documents, untimed: imports, numpy's first allocations, Tessera's power table."""
    run_tessera(texts, MinHashConfig(bands=BANDS, rows=ROWS, seed=SEED), Stages())
    if "datasketch" not in skip and importlib.util.find_spec("datasketch"):
        run_datasketch(texts, Stages())
    if "datatrove" not in skip and importlib.util.find_spec("datatrove"):
        run_datatrove(texts, Stages())


def bench_corpus(bench: DedupBenchmark, skip: set[str]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    texts, n = bench.texts, len(bench.texts)
    warm_up(texts[:200], skip)
    plain = MinHashConfig(bands=BANDS, rows=ROWS, seed=SEED, probe=False, verify_threshold=None)
    measure(rows, "tessera plain", bench, lambda st: run_tessera(texts, plain, st))
    measure(rows, "tessera plain + verify", bench,
            lambda st: run_tessera(texts, MinHashConfig(bands=BANDS, rows=ROWS, seed=SEED, probe=False), st))
    measure(rows, DEFAULT_ROW, bench, lambda st: run_tessera(texts, _DEFAULT, st))
    if "probe" not in skip:  # the default before 20 x 5: the same curve from 112 keys a document
        measure(rows, PROBE_ROW, bench,
                lambda st: run_tessera(texts, MinHashConfig(bands=BANDS, rows=ROWS, seed=SEED, probe=True), st))
    if "kperm" not in skip:  # the scheme before one permutation hashing, for its speed and accuracy in this run
        kperm = MinHashConfig(bands=BANDS, rows=ROWS, seed=SEED, probe=False, verify_threshold=None, scheme="kperm")
        measure(rows, "tessera plain, kperm", bench, lambda st: run_tessera(texts, kperm, st))
        measure(rows, "tessera default, kperm", bench,
                lambda st: run_tessera(texts, MinHashConfig(seed=SEED, scheme="kperm"), st))
    for peer in ("datasketch", "datatrove"):
        if peer in skip:
            continue
        try:
            __import__(peer)
        except ImportError:
            print(f"  {peer}: not installed here, skipped (see the docstring for the bench venv)")
            continue
        runner = run_datasketch if peer == "datasketch" else run_datatrove
        for label, bands, rows_per_band in (("", BANDS, ROWS), (f" {DEFAULT_BANDING}", _DEFAULT.bands, _DEFAULT.rows)):
            found: dict[str, Any] = {}

            def plain_run(st: Stages, bands: int = bands, r: int = rows_per_band, found: dict[str, Any] = found,
                          run: Callable[..., tuple[NearDedupResult, np.ndarray]] = runner) -> NearDedupResult:
                result, found["pairs"] = run(texts, st, bands, r)
                return result

            def verify_pass(st: Stages, found: dict[str, Any] = found) -> NearDedupResult:
                with st("verify post-pass"):  # shingles its documents again: no peer keeps them (memory)
                    edges = verify(found["pairs"], lambda i: shingles(texts[i]))
                with st("clustering"):
                    return cluster_edges(n, edges, len(found["pairs"]))

            measure(rows, f"{peer}{label} plain", bench, plain_run)
            measure(rows, f"{peer}{label} verify post-pass alone", bench, verify_pass)
            both = dict(rows[f"{peer}{label} verify post-pass alone"])
            both["cpu_s"] = rows[f"{peer}{label} plain"]["cpu_s"] + both["cpu_s"]
            both["docs_per_cpu_s"] = n / both["cpu_s"]
            rows[f"{peer}{label} plain + verify post-pass"] = both
    return rows


def load_corpus(kind: str, n: int, seed: int, cache: Path, copy_fraction: float = 0.1) -> DedupBenchmark:
    path = cache / (f"corpus-{kind}-{n}-{seed}.pkl" if copy_fraction == 0.1
                    else f"corpus-{kind}-{n}-{seed}-copies{copy_fraction:g}.pkl")
    if path.is_file():
        bench: DedupBenchmark = pickle.loads(path.read_bytes())
        return bench
    bench = make_corpus(kind, n, seed=seed, copy_fraction=copy_fraction)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(bench))
    return bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20_000, help="documents per corpus (10^6 for the headline)")
    parser.add_argument("--corpus", nargs="+", default=["code", "prose"], choices=["code", "prose"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-fraction", type=float, default=0.1,
                        help="generated near-copies as a fraction of --docs (0.02 at 10^6: 20,000 pairs, each "
                             "found by bisection on truth Jaccard)")
    parser.add_argument("--cache", default=".cache/tessera/dedup_bench")
    parser.add_argument("--skip", nargs="*", default=[], help="rows to skip: datatrove datasketch kperm probe")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--sweep", nargs="*", type=float, default=list(SWEEP),
                        help="verification thresholds for the accuracy sweep of the default banding (none: skip)")
    parser.add_argument("--png", help="plot the threshold sweeps here")
    parser.add_argument("--dry", action="store_true", help="a 400-document run of every row, uncached")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: dict[str, Any] = {"python": sys.version.split()[0], "load_before": os.getloadavg()[0], "corpora": {}}
    sweeps: dict[str, dict[str, Any]] = {}
    for kind in args.corpus:
        bench = (make_corpus(kind, 400, seed=args.seed, only=_DRY_GROUPS[kind]) if args.dry
                 else load_corpus(kind, args.docs, args.seed, Path(args.cache), args.copy_fraction))
        hist = jaccard_histogram(bench)
        print(f"{kind}: {len(bench.texts)} documents, {len(bench.pairs)} known pairs (truth J per origin: "
              f"{json.dumps(hist)}); load {os.getloadavg()[0]:.1f}", flush=True)
        rows = bench_corpus(bench, set(args.skip))
        if args.sweep:
            sweeps[kind] = threshold_sweep(bench, args.sweep)
        for peer in ("datasketch", "datatrove"):
            if f"{peer} plain" in rows:
                plain = rows["tessera plain"]["docs_per_cpu_s"] / rows[f"{peer} plain"]["docs_per_cpu_s"]
                full = (rows[DEFAULT_ROW]["docs_per_cpu_s"]
                        / rows[f"{peer} {DEFAULT_BANDING} plain + verify post-pass"]["docs_per_cpu_s"])
                old = (rows[DEFAULT_ROW]["docs_per_cpu_s"] / rows[f"{peer} plain + verify post-pass"]["docs_per_cpu_s"])
                print(f"  tessera plain / {peer} plain: {plain:.1f}x   tessera default / {peer} {DEFAULT_BANDING} "
                      f"+ verify: {full:.1f}x (/ {peer} {BANDS}x{ROWS} + verify: {old:.1f}x)")
        out["corpora"][kind] = {"documents": len(bench.texts), "known_pairs": hist, "rows": rows,
                                "threshold_sweep": sweeps.get(kind)}
    out["load_after"] = os.getloadavg()[0]
    if args.png and sweeps:
        plot_sweeps(sweeps, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
