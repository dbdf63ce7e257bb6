"""Near-duplicate ground truth: natural and generated pairs, Jaccard computed independently of Tessera.

Truth Jaccard (`true_jaccard`): 5-grams of whitespace-separated tokens, case and punctuation kept, as plain
Python sets of tuples. Tessera's MinHash sees lower-cased alphanumeric words (`data_pipeline.build.shingles`), so the
truth never shares its tokenizer: `def f(x):` is tokens `def`, `f(x):` here and words `def`, `f`, `x` there.

Two corpora, each of natural documents found on this machine plus generated ones:
  code : every `.py` file of every Python installation (each pyenv version's standard library and
         site-packages, the system's, virtual environments, pip's vendored copies), cut to its first
         `max_words` tokens. One file across versions (`json/decoder.py` in 2.7 ... 3.13, `requests/api.py`
         standalone and under `pip/_vendor`) gives natural near-duplicates and hard negatives.
  prose: licence, copyright, README and METADATA files (dist-info, /usr/share/doc, common-licenses):
         licence variants (MIT with another holder), one package's README across versions.
Known pairs: every pair inside a group (same relative path, same package, same licence file name; groups
sampled down to `_GROUP_CAP` members) whose truth Jaccard is >= 0.5, plus each generated copy with its source
(word swaps, insertions, deletions or truncation down to a target drawn evenly from 0.5-0.95). Filler
documents (lines drawn at random from the whole pool) bring a corpus to any size, e.g. 10^6 documents.

recall@0.8 (`removal_recall`, the headline): share of known pairs with truth J >= 0.8 not both kept — the dedup
outcome: at least one copy is gone from the training data.
same-cluster recall@0.8 (`same_cluster_recall`): share of those pairs whose two documents end in one cluster. Star
clusters never chain, so it is lower where a pair's copies sit under two kept documents that are not near each
other; `split_pairs` counts the pairs it misses by cause.
pair precision@0.7: share of removed documents whose truth J with some kept member of their cluster is >= 0.7
(the most favourable kept partner, the same rule for every tool); `precision_by_origin` splits it by what the
removed document is, because the mix of natural pairs, generated copies and filler moves with the corpus size.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import random
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.dedup import NearDedupResult
from data_pipeline.build.stdlib_corpus import list_stdlib_files

_WORDS = re.compile(r"\w+")
_GROUP_CAP = 120
"""Most members of one group compared pairwise (quadratic in this, linear in the corpus)."""
_LIB_PATTERNS = ("/root/.pyenv/versions/*/lib/python*", "/usr/lib/python3*", "/usr/local/lib/python3*",
                 "/work/main/.venv/lib/python*", "/tmp/benchvenv/lib/python*")
_PROSE_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS", "README", "METADATA", "copyright", "NEWS",
                "CHANGES", "HISTORY")


def truth_shingles(text: str, n: int = 5) -> frozenset[tuple[str, ...]]:
    """5-grams of whitespace tokens (case and punctuation kept); one shingle for a shorter text."""
    t = text.split()
    return frozenset(tuple(t[i:i + n]) for i in range(max(1, len(t) - n + 1)))


def set_jaccard(a: frozenset[tuple[str, ...]], b: frozenset[tuple[str, ...]]) -> float:
    inter = len(a & b)
    return inter / max(1, len(a) + len(b) - inter)


def true_jaccard(a: str, b: str, n: int = 5) -> float:
    """The ground-truth Jaccard of two texts (see the module docstring)."""
    return set_jaccard(truth_shingles(a, n), truth_shingles(b, n))


def word_shingles(text: str, n: int = 5) -> frozenset[tuple[str, ...]]:
    """Lower-cased `\\w+` word n-grams: the shingles MinHash hashes, for the in-tokenizer CI benchmark."""
    w = _WORDS.findall(text.lower())
    return frozenset(tuple(w[i:i + n]) for i in range(max(1, len(w) - n + 1)))


_TRUTH = {"tokens": truth_shingles, "words": word_shingles}


@dataclass
class DedupBenchmark:
    texts: list[str]
    pairs: list[tuple[int, int, float]]
    """(document, document, truth Jaccard) of the known pairs."""
    origin: list[str] = field(default_factory=list)
    """Per known pair: 'natural' or 'generated'."""
    groups: list[str] = field(default_factory=list)
    """Per document: its group key ('' for generated and filler documents)."""
    truth: str = "tokens"
    """Shingles of the truth Jaccard: 'tokens' (independent, see the module docstring) or 'words' (MinHash's)."""


@dataclass(frozen=True)
class NaturalDoc:
    text: str
    group: str
    path: str


def _read(path: Path) -> str | None:
    try:
        raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def _lib_dirs() -> list[Path]:
    found = {Path(p) for pat in _LIB_PATTERNS for p in glob.glob(pat)}
    found.add(Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}")
    return sorted(d for d in found if d.is_dir())


def _code_group(rel: Path) -> str:
    """The file's identity across installations: path below site-packages / pip's _vendor, else below lib."""
    parts = rel.parts
    for marker in ("_vendor", "site-packages", "dist-packages"):
        if marker in parts:
            parts = parts[len(parts) - parts[::-1].index(marker):]
    return "code:" + "/".join(parts)


def _prose_group(path: Path) -> str:
    """Licence files group by name (licence variants across packages); README/METADATA by package."""
    name = path.name.split(".")[0].upper()
    parent = path.parent.name
    if name in ("README", "METADATA"):
        return f"prose:{name}:{parent.split('-')[0].lower()}"
    return f"prose:{name}"


def iter_natural(kind: str, max_words: int = 1000, only: str = "") -> Iterator[NaturalDoc]:
    """Natural documents of `kind` ('code' or 'prose') found on this machine, each cut to `max_words` tokens;
    `only` keeps the groups whose key starts with it (e.g. 'code:json/' for a quick run)."""
    if kind == "code":
        dirs = _lib_dirs()
        if not dirs:  # an unusual layout: the running interpreter's standard library only
            files = [(p, "code:" + p.name) for _, p in list_stdlib_files()]
        else:
            files = [(p, _code_group(p.relative_to(d))) for d in dirs for p in sorted(d.rglob("*.py"))]
    elif kind == "prose":
        roots = [*_lib_dirs(), Path("/usr/share/doc"), Path("/usr/share/common-licenses")]
        files = [(p, _prose_group(p)) for r in roots if r.is_dir() for p in sorted(r.rglob("*"))
                 if p.name.split(".")[0].upper() in {n.upper() for n in _PROSE_NAMES} and p.is_file()]
    else:
        raise ValueError(f"kind={kind!r}: expected 'code' or 'prose'")
    for path, group in files:
        if not group.startswith(only):
            continue
        text = _read(path)
        if text is None:
            continue
        lines, words = [], 0
        for line in text.splitlines():  # whole lines, so the layout (and the filler's line pool) survives
            if words >= max_words:
                break
            lines.append(line)
            words += len(line.split())
        if words >= 30:
            yield NaturalDoc("\n".join(lines), group, str(path))


def mutate(text: str, target: float, rng: random.Random,
           shingle: Callable[[str], frozenset[tuple[str, ...]]] = truth_shingles) -> str:
    """A copy of `text` with one kind of edit applied until its Jaccard (of `shingle` sets) with `text` is about
    `target`.

    The edits are drawn once; the number applied is found by bisection (truth J falls as edits grow)."""
    words = text.split()
    kind = rng.choice(["swap", "insert", "delete", "truncate"])
    if kind == "truncate":
        def edited(k: int) -> list[str]:
            return words[:max(10, len(words) - k)]
    else:
        ops = [(rng.randrange(len(words)), rng.randrange(len(words)), rng.choice(words) + rng.choice(["", "_x", "2"]))
               for _ in range(len(words))]

        def edited(k: int) -> list[str]:
            out = list(words)
            for i, j, w in ops[:k]:
                i %= len(out)
                if kind == "swap":
                    j %= len(out)
                    out[i], out[j] = out[j], out[i]
                elif kind == "insert":
                    out.insert(i, w)
                elif len(out) > 10:
                    del out[i]
            return out
    base = shingle(text)
    lo, hi = 1, len(words)
    while lo < hi:  # smallest k with J(k) <= target
        mid = (lo + hi) // 2
        if set_jaccard(base, shingle(" ".join(edited(mid)))) <= target:
            hi = mid
        else:
            lo = mid + 1
    # Stop at whichever side of the target is closer (never at an unchanged copy).
    cand = [" ".join(edited(k)) for k in {max(1, lo - 1), lo}]
    return min(cand, key=lambda c: (abs(set_jaccard(base, shingle(c)) - target), c == text))


def replace_letters(text: str, rng: random.Random, frac: float = 0.02) -> str:
    """A near copy of text in any script: `frac` of its non-ASCII letters replaced by other letters of the same
    text (in Chinese, Japanese or Thai a share of the words; in spaced scripts about 5x that share of words)."""
    chars = list(text)
    idx = [i for i, c in enumerate(chars) if c.isalpha() and not c.isascii()]
    pool = [chars[i] for i in idx]
    for i in rng.sample(idx, max(1, round(frac * len(idx)))):
        c = chars[i]
        while c == chars[i] and len(set(pool)) > 1:
            c = rng.choice(pool)
        chars[i] = c
    return "".join(chars)


def filler(pool: list[str], rng: random.Random) -> str:
    """A document of 150-400 words made of lines drawn at random from `pool` (far from every other)."""
    lines: list[str] = []
    words, target = 0, rng.randint(150, 400)
    while words < target:
        doc = pool[rng.randrange(len(pool))].splitlines() or ["x"]
        line = doc[rng.randrange(len(doc))]
        lines.append(line)
        words += len(line.split())
    return "\n".join(lines)


def _group_pairs(members: list[int], texts: list[str], rng: random.Random) -> list[tuple[int, int, float]]:
    if len(members) > _GROUP_CAP:
        members = sorted(rng.sample(members, _GROUP_CAP))
    sets = [truth_shingles(texts[m]) for m in members]
    out = []
    for a in range(len(members)):
        for b in range(a + 1, len(members)):
            j = set_jaccard(sets[a], sets[b])
            if j >= 0.5:
                out.append((members[a], members[b], j))
    return out


def make_corpus(kind: str, n_docs: int, *, seed: int = 0, copy_fraction: float = 0.1,
                max_words: int = 1000, only: str = "") -> DedupBenchmark:
    """`n_docs` documents: natural ones (whole groups, exact copies dropped), generated copies, then filler."""
    rng = random.Random(seed)
    by_group: dict[str, list[str]] = defaultdict(list)
    seen: set[bytes] = set()
    for doc in iter_natural(kind, max_words, only):
        digest = hashlib.blake2b(doc.text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if digest not in seen:  # exact copies are the exact-dedup stage's work, not near dedup's
            seen.add(digest)
            by_group[doc.group].append(doc.text)
    if not by_group:
        raise FileNotFoundError(f"no natural {kind} documents found under {_LIB_PATTERNS}")
    n_copies = int(n_docs * copy_fraction)
    names = sorted(by_group)
    rng.shuffle(names)
    texts: list[str] = []
    groups: list[str] = []
    for name in names:  # whole groups, so natural pairs stay together
        if len(texts) + len(by_group[name]) > n_docs - n_copies:
            continue
        texts.extend(by_group[name])
        groups.extend([name] * len(by_group[name]))
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    pairs = [p for g in sorted(members) if len(members[g]) > 1 for p in _group_pairs(members[g], texts, rng)]
    origin = ["natural"] * len(pairs)
    n_natural = len(texts)
    for k in range(n_copies):
        src = rng.randrange(n_natural)
        target = 0.5 + 0.45 * (k + rng.random()) / max(1, n_copies)
        texts.append(mutate(texts[src], target, rng))
        groups.append("")
        pairs.append((src, len(texts) - 1, true_jaccard(texts[src], texts[-1])))
        origin.append("generated")
    pool = texts[:n_natural]
    while len(texts) < n_docs:
        texts.append(filler(pool, rng))
        groups.append("")
    return DedupBenchmark(texts, pairs, origin, groups)


def make_benchmark(n_base: int, n_copies: int, seed: int = 0) -> DedupBenchmark:
    """The small in-tokenizer CI benchmark: `n_base` standard-library chunks (150-400 words) and mutated copies,
    its truth in MinHash's own word shingles (a check of LSH + verification, not of the tokenizer's choice)."""
    rng = random.Random(seed)
    texts: list[str] = []
    for _, path in sorted(list_stdlib_files(), key=lambda item: item[0] != "code"):  # code files, then tests
        try:
            words = path.read_text(encoding="utf-8").split()
        except (UnicodeDecodeError, OSError):
            continue
        i = 0
        while i + 150 <= len(words) and len(texts) < n_base:
            n = rng.randint(150, 400)
            texts.append(" ".join(words[i:i + n]))
            i += n
        if len(texts) == n_base:
            break
    pairs = []
    for k in range(n_copies):
        src = rng.randrange(len(texts[:n_base]))
        target = 0.5 + 0.45 * (k + rng.random()) / n_copies
        texts.append(mutate(texts[src], target, rng, word_shingles))
        pairs.append((src, len(texts) - 1, set_jaccard(word_shingles(texts[src]), word_shingles(texts[-1]))))
    return DedupBenchmark(texts, pairs, ["generated"] * len(pairs), truth="words")


CACHE_SETS = 50_000
"""Truth shingle sets the metrics hold at once (at 10^6 documents every removed one's set would not fit)."""


def recall_precision(bench: DedupBenchmark, result: NearDedupResult) -> tuple[float, float]:
    """(recall@0.8, pair precision@0.7) of a dedup result on the benchmark, in its truth Jaccard."""
    _, good = removed_precision(bench, result)
    return same_cluster_recall(bench, result), float(good.mean()) if len(good) else 0.0


def same_cluster_recall(bench: DedupBenchmark, result: NearDedupResult) -> float:
    """Share of known pairs with truth J >= 0.8 whose two documents end in one cluster."""
    hard = [(a, b) for a, b, j in bench.pairs if j >= 0.8]
    return float(sum(result.cluster[a] == result.cluster[b] for a, b in hard) / max(1, len(hard)))


def removed_precision(bench: DedupBenchmark, result: NearDedupResult) -> tuple[np.ndarray, np.ndarray]:
    """The removed documents and, for each, whether its truth J with some kept member of its cluster is >= 0.7
    (the mean of the second is pair precision@0.7)."""
    shingle = _TRUTH[bench.truth]
    removed = np.flatnonzero(~result.keep)
    order = np.argsort(result.cluster, kind="stable")
    labels = result.cluster[order]
    cache: dict[int, frozenset[tuple[str, ...]]] = {}

    def sh(i: int) -> frozenset[tuple[str, ...]]:
        if i not in cache:
            if len(cache) >= CACHE_SETS:
                cache.clear()
            cache[i] = shingle(bench.texts[i])
        return cache[i]

    good = np.zeros(len(removed), dtype=bool)
    for n, r in enumerate(removed.tolist()):
        lo, hi = np.searchsorted(labels, result.cluster[r]), np.searchsorted(labels, result.cluster[r], "right")
        kept = [int(k) for k in order[lo:hi] if result.keep[k]]
        good[n] = any(set_jaccard(sh(r), sh(k)) >= 0.7 for k in kept)
    return removed, good


def precision_by_origin(bench: DedupBenchmark, removed: np.ndarray, good: np.ndarray) -> dict[str, dict[str, Any]]:
    """`removed_precision`'s result split by what each removed document is: "generated copy" (the copy of a
    generated pair), "natural" (a member of a natural known pair), "natural, unpaired" (a natural file in no known
    pair), "filler" (lines drawn at random; with `groups` unknown, filler and unpaired files are one class,
    "other"). Each: removed documents and their precision@0.7. The mix moves with the corpus size (the natural pairs
    are what this machine holds; generated copies and filler scale with it), so one overall figure compares badly
    across sizes."""
    kind: dict[int, str] = {}
    for (a, b, _), o in zip(bench.pairs, bench.origin or ["generated"] * len(bench.pairs), strict=True):
        if o == "generated":
            kind[b] = "generated copy"
        else:
            kind.setdefault(a, "natural")
            kind.setdefault(b, "natural")
    out: dict[str, dict[str, Any]] = {}
    for r, g in zip(removed.tolist(), good.tolist(), strict=True):
        other = ("other" if len(bench.groups) != len(bench.texts)
                 else "natural, unpaired" if bench.groups[r] else "filler")
        row = out.setdefault(kind.get(r, other), {"removed": 0, "good": 0})
        row["removed"] += 1
        row["good"] += g
    return {k: {"removed": v["removed"], "precision@0.7": v["good"] / v["removed"]} for k, v in sorted(out.items())}


def split_pairs(bench: DedupBenchmark, result: NearDedupResult) -> dict[str, int]:
    """Why known pairs of truth J >= 0.8 end in two clusters. "both kept": neither copy removed (missed). "chain":
    the kept documents of their two clusters are below truth J 0.7 of each other, so one cluster for the pair would
    join two unrelated kept documents — the chaining star clusters exist to avoid. "near kept": those kept
    documents are themselves of truth J >= 0.7 (both kept: no verified edge joins them), or a cluster label is not a
    document (datatrove's component ids). "pairs": all pairs of J >= 0.8."""
    shingle = _TRUTH[bench.truth]
    out = {"pairs": 0, "both kept": 0, "chain": 0, "near kept": 0}
    for a, b, j in bench.pairs:
        if j < 0.8:
            continue
        out["pairs"] += 1
        ca, cb = int(result.cluster[a]), int(result.cluster[b])
        if ca == cb:
            continue
        if result.keep[a] and result.keep[b]:
            out["both kept"] += 1
        elif max(ca, cb) < len(bench.texts) and set_jaccard(shingle(bench.texts[ca]), shingle(bench.texts[cb])) < 0.7:
            out["chain"] += 1
        else:
            out["near kept"] += 1
    return out


def removal_recall(bench: DedupBenchmark, result: NearDedupResult) -> float:
    """Share of known pairs with truth J >= 0.8 of which at least one document is removed."""
    hard = np.array([(a, b) for a, b, j in bench.pairs if j >= 0.8], dtype=np.int64).reshape(-1, 2)
    return float((~(result.keep[hard[:, 0]] & result.keep[hard[:, 1]])).mean()) if len(hard) else 1.0


def jaccard_histogram(bench: DedupBenchmark) -> dict[str, dict[str, int]]:
    """Known pairs per origin and truth-J bin (0.5-0.6, ..., 0.9-1.0)."""
    out: dict[str, dict[str, int]] = {}
    for (_, _, j), o in zip(bench.pairs, bench.origin or ["generated"] * len(bench.pairs), strict=True):
        b = min(9, int(j * 10))
        key = f"{b / 10:.1f}-{(b + 1) / 10:.1f}"
        out.setdefault(o, {}).setdefault(key, 0)
        out[o][key] += 1
    return {o: dict(sorted(h.items())) for o, h in out.items()}
