"""Decontamination: documents that share word n-grams (13 by default, as GPT-3 and datatrove) with an evaluation set
are removed, or lose the lines holding the shared n-grams (`policy: mask`), before anything else sees them.

Evaluation sets are JSONL files: Tessera's downstream task files (framework/infer/tasks.py: a passage is the
context followed by each choice, or by the continuation) or any records (a passage is all their string values);
pre-tokenized items are skipped. The words are near dedup's (lower-cased runs of letters and digits, each
character of a script written without spaces a word: data_pipeline/text_units.py), hashed as its shingles, so
case, punctuation and spacing differences do not hide an overlap. A passage shorter than the n-gram has no n-gram
and is counted under `short` in the log. Each document's reason names the benchmark with the most shared n-grams
(`decontaminate.<benchmark>`): the manifest counts documents and characters per benchmark apart from the filters.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from data_pipeline.build.shingles import shingle_hashes, word_hashes
from framework.base.errors import ConfigError

PREFIX = "decontaminate."
"""The reason of a document removed (or the trim key of lines masked) for a benchmark: PREFIX + its name."""


@dataclass(kw_only=True, frozen=True)
class DecontaminateFilter:
    benchmarks: list[str] = field(default_factory=list)
    """JSONL evaluation sets (downstream task files, or any records); empty: no decontamination. A benchmark is
    named by its file's stem."""
    ngram: int = 13
    """Words per n-gram (GPT-3's 13)."""
    policy: Literal["remove", "mask"] = "remove"
    """remove: the whole document; mask: the lines holding a shared n-gram (the document is removed when nothing
    is left)."""
    min_ngrams: int = 1
    """Shared n-grams from which a document counts as contaminated."""

    def validate(self) -> None:
        if self.ngram < 5:
            raise ConfigError(f"filters.decontaminate.ngram={self.ngram} must be >= 5: shorter n-grams match common "
                              f"phrases of any text (13 is GPT-3's)")
        if self.min_ngrams < 1:
            raise ConfigError(f"filters.decontaminate.min_ngrams={self.min_ngrams} must be >= 1")
        names = [Path(b).stem for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ConfigError(f"filters.decontaminate.benchmarks {self.benchmarks} has two files of one name; "
                              f"benchmarks are named by their file's stem")
        for b in self.benchmarks:
            if not Path(b).is_file():
                raise ConfigError(f"filters.decontaminate.benchmarks: {b!r} is not a file; give JSONL evaluation "
                                  f"sets (task files: framework/infer/tasks.py)")


def passages(obj: Any) -> list[str]:
    """The texts of one evaluation record: context + each choice or the continuation for a task item, else its
    string values joined."""
    if not isinstance(obj, dict):
        return [obj] if isinstance(obj, str) else []
    context = obj.get("context")
    if isinstance(context, str):
        ends = obj.get("choices") or [obj.get("continuation", "")]
        return [context + e for e in ends if isinstance(e, str)]
    return ["\n".join(v for v in obj.values() if isinstance(v, str))]


@functools.lru_cache(maxsize=4)
def ngram_table(benchmarks: tuple[str, ...], ngram: int) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """(every benchmark n-gram hash, sorted; the benchmark of each; passages per benchmark too short to have
    one). Loaded once per process (ingest workers)."""
    hashes, owner, short = [], [], {}
    for b, path in enumerate(benchmarks):
        texts = [p for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()
                 for p in passages(json.loads(line))]
        _, first = word_hashes(texts)
        long = [t for t, n in zip(texts, np.diff(first).tolist(), strict=True) if n >= ngram]
        short[Path(path).stem] = len(texts) - len(long)
        h, _ = shingle_hashes(long, ngram)
        hashes.append(h)
        owner.append(np.full(len(h), b, dtype=np.int32))
    h = np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)
    o = np.concatenate(owner) if owner else np.zeros(0, dtype=np.int32)
    order = np.argsort(h, kind="stable")
    return h[order], o[order], short


def decontaminate(text: str, c: DecontaminateFilter) -> tuple[str | None, str | None]:
    """(text to keep or None, the reason `decontaminate.<benchmark>` or None when no n-gram is shared). Under
    `mask` a kept text with lines cut comes with its reason too (the trim is accounted under it)."""
    table, owner, _ = ngram_table(tuple(c.benchmarks), c.ngram)
    if not len(table):
        return text, None
    # A text of fewer words than the n-gram has one clipped shingle, which no full n-gram of the table equals.
    h, _ = shingle_hashes([text], c.ngram)
    pos = np.minimum(np.searchsorted(table, h), len(table) - 1)
    hit = np.flatnonzero(table[pos] == h)
    if len(hit) < c.min_ngrams:
        return text, None
    bench = Path(c.benchmarks[Counter(owner[pos[hit]].tolist()).most_common(1)[0][0]]).stem
    if c.policy == "remove":
        return None, PREFIX + bench
    lines = text.split("\n")
    _, first = word_hashes(lines)  # the words of the text are its lines' words, in order
    covered = np.zeros(int(first[-1]), dtype=bool)
    for i in hit.tolist():
        covered[i:i + c.ngram] = True
    drop = set((np.searchsorted(first, np.flatnonzero(covered), side="right") - 1).tolist())
    kept = [line for k, line in enumerate(lines) if k not in drop]
    if not "".join(kept).strip():
        return None, PREFIX + bench
    return "\n".join(kept), PREFIX + bench


def split_counts(counts: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(filter reasons, decontamination reasons by benchmark) of a source's `filtered` counts."""
    return ({r: n for r, n in counts.items() if not r.startswith(PREFIX)},
            {r[len(PREFIX):]: n for r, n in counts.items() if r.startswith(PREFIX)})
