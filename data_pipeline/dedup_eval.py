"""A generated near-duplicate benchmark with known pairs, and the recall/precision measures of docs/DATA.md.

Base documents: the standard library's .py files cut into 150-400-word chunks. Mutated copies: word swaps,
insertions, deletions or truncation applied until the copy's true word-5-gram Jaccard with its original falls
to a target drawn evenly from [0.5, 0.95].
recall@0.8: share of known pairs with Jaccard >= 0.8 that end in one cluster.
precision@0.7: share of removed documents whose Jaccard with a kept member of their cluster is >= 0.7.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

from data_pipeline.dedup import NearDedupResult
from data_pipeline.stdlib_corpus import list_stdlib_files

_WORDS = re.compile(r"\w+")


def word_shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """The exact word n-gram set (lower-cased `\\w+` words), as the MinHash stage sees the text."""
    w = _WORDS.findall(text.lower())
    return {tuple(w[i:i + n]) for i in range(max(1, len(w) - n + 1))}


def true_jaccard(a: str, b: str, n: int = 5) -> float:
    sa, sb = word_shingles(a, n), word_shingles(b, n)
    return len(sa & sb) / max(1, len(sa | sb))


def stdlib_chunks(count: int, seed: int = 0) -> list[str]:
    """`count` chunks of 150-400 whitespace words from the standard library's .py files (code first, then tests)."""
    rng = random.Random(seed)
    out: list[str] = []
    for _, path in sorted(list_stdlib_files(), key=lambda item: item[0] != "code"):  # code files, then tests
        try:
            words = path.read_text(encoding="utf-8").split()
        except (UnicodeDecodeError, OSError):
            continue
        i = 0
        while i + 150 <= len(words):
            n = rng.randint(150, 400)
            out.append(" ".join(words[i:i + n]))
            i += n
            if len(out) == count:
                return out
    return out


def mutate(text: str, target: float, rng: random.Random) -> str:
    """A copy of `text` edited (one kind of edit) until its Jaccard with `text` is about `target`."""
    words = text.split()
    kind = rng.choice(["swap", "insert", "delete", "truncate"])
    if kind == "truncate":
        keep = len(words)
        while keep > 10 and true_jaccard(text, " ".join(words[:keep])) > target:
            keep -= 1
        return " ".join(words[:keep])
    out = list(words)
    while len(out) > 10:  # one edit at a time, so the result lands close to the target
        prev = list(out)
        i = rng.randrange(len(out))
        if kind == "swap":
            j = rng.randrange(len(out))
            out[i], out[j] = out[j], out[i]
        elif kind == "insert":
            out.insert(i, rng.choice(words) + rng.choice(["", "_x", "2"]))
        else:
            del out[i]
        j_now = true_jaccard(text, " ".join(out))
        if j_now <= target:
            # Stop at whichever side of the target is closer (never at an unchanged copy).
            j_prev = true_jaccard(text, " ".join(prev))
            return " ".join(prev if j_prev < 1.0 and j_prev - target < target - j_now else out)
    return " ".join(out)


@dataclass
class DedupBenchmark:
    texts: list[str]
    pairs: list[tuple[int, int, float]]
    """(original index, copy index, true Jaccard)."""


def make_benchmark(n_base: int, n_copies: int, seed: int = 0) -> DedupBenchmark:
    """Base chunks followed by mutated copies of randomly chosen bases (targets even over [0.5, 0.95])."""
    rng = random.Random(seed)
    texts = stdlib_chunks(n_base, seed)
    pairs = []
    for k in range(n_copies):
        src = rng.randrange(len(texts[:n_base]))
        target = 0.5 + 0.45 * (k + rng.random()) / n_copies
        copy = mutate(texts[src], target, rng)
        texts.append(copy)
        pairs.append((src, len(texts) - 1, true_jaccard(texts[src], copy)))
    return DedupBenchmark(texts, pairs)


def recall_precision(bench: DedupBenchmark, result: NearDedupResult) -> tuple[float, float]:
    """(recall@0.8, precision@0.7) of a dedup result on the benchmark."""
    hard = [(a, b) for a, b, j in bench.pairs if j >= 0.8]
    recall = sum(result.cluster[a] == result.cluster[b] for a, b in hard) / max(1, len(hard))
    removed = np.flatnonzero(~result.keep)
    good = 0
    for r in removed:
        kept = np.flatnonzero((result.cluster == result.cluster[r]) & result.keep)
        good += any(true_jaccard(bench.texts[r], bench.texts[k]) >= 0.7 for k in kept)
    return float(recall), good / max(1, len(removed))
