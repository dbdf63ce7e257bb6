"""Tokens of the text the filters removed, per rule, counted with the build's own tokenizer.

The tokenizer may be trained after ingest (from the kept text), so removed text cannot be tokenized when it is
removed. Ingest keeps, per rule, a uniform reservoir sample (Vitter's algorithm R, seeded) of the removed pieces —
a filtered document's normalized text, or the lines a line rule cut from a kept one — and the normalized
characters of all of them. Once the tokenizer exists the sample is tokenized: a rule whose pieces all fit in the
reservoir gets its exact token count; a larger one gets tokens(sample) / chars(sample) x chars(all), an unbiased
ratio estimate, marked estimated. Documents count their EOS, as kept ones do; cut lines do not.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SAMPLE_PIECES = 256
"""Removed pieces kept per rule and source (memory: a few MB per rule at typical document sizes)."""


class RemovedSample:
    def __init__(self, seed: int, size: int | None = None) -> None:
        self.rng, self.size = random.Random(seed), size or SAMPLE_PIECES
        self.pieces: dict[str, list[str]] = {}
        self.seen: dict[str, int] = {}
        self.chars: dict[str, int] = {}

    def add(self, reason: str, text: str) -> None:
        n = self.seen.get(reason, 0) + 1
        self.seen[reason], self.chars[reason] = n, self.chars.get(reason, 0) + len(text)
        pieces = self.pieces.setdefault(reason, [])
        if len(pieces) < self.size:
            pieces.append(text)
        else:
            j = self.rng.randrange(n)
            if j < self.size:
                pieces[j] = text

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for reason in sorted(self.pieces):
                f.write(json.dumps({"reason": reason, "seen": self.seen[reason], "chars": self.chars[reason],
                                    "pieces": self.pieces[reason]}, ensure_ascii=False) + "\n")
        tmp.replace(path)


def count_removed_tokens(paths: list[Path], tok: Any) -> dict[str, Any]:
    """{"filtered": {rule: tokens}, "trimmed": {rule.lines: tokens}, "estimated": [rules]} from saved samples
    (several files, e.g. one per ingest task of a split source, add up: each part's count or estimate is unbiased
    for its part); empty when the build predates them. `tok` is the build's Tokenizer."""
    out: dict[str, Any] = {"filtered": {}, "trimmed": {}, "estimated": []}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                lines = r["reason"].endswith(".lines")
                tokens = sum(len(ids) - lines for ids in tok.encode_docs(r["pieces"])) if r["pieces"] else 0
                if len(r["pieces"]) < r["seen"]:
                    tokens = round(tokens * r["chars"] / max(1, sum(map(len, r["pieces"]))))
                    if r["reason"] not in out["estimated"]:
                        out["estimated"].append(r["reason"])
                part = out["trimmed" if lines else "filtered"]
                part[r["reason"]] = part.get(r["reason"], 0) + int(tokens)
    out["estimated"].sort()
    return out
