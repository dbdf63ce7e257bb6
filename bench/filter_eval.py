"""Filter profiles scored against hand labels: characters (and documents) wrongly dropped and wrongly kept.

The labelled sample lives in tests/fixtures/labelled (texts.jsonl, labels.txt; see its README). A label says which
lines of a document a careful curator keeps; a profile's output is mapped back onto those lines (filters and
boilerplate removal only ever drop whole lines, so the kept text is a subsequence of the input's lines).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.build.filters import PROFILES, FiltersConfig, apply_filters, binary_reason
from data_pipeline.build.filters import kept_lines as filters_kept_lines
from data_pipeline.build.normalize import NormalizeConfig, normalize

_LABEL = re.compile(r"^(?P<id>\S+)\s+(?P<verdict>keep|drop|drop-lines\s+(?P<lines>[\d,\-]+))\s*(#.*)?$")


@dataclass(kw_only=True, frozen=True)
class LabelledDoc:
    id: str
    profile: str
    origin: str
    text: str
    keep: tuple[bool, ...]
    """Per line of `text`: should a profile for this kind of text keep it."""


@dataclass(kw_only=True)
class Score:
    docs: int = 0
    chars: int = 0
    """Characters in lines (newlines not counted)."""
    chars_should_keep: int = 0
    chars_kept: int = 0
    wrongly_dropped: int = 0
    """Characters labelled keep that the profile removed."""
    wrongly_kept: int = 0
    """Characters labelled drop that the profile kept."""
    docs_should_keep: int = 0
    docs_wrongly_dropped: int = 0
    """Documents with something to keep that the profile dropped whole."""
    docs_should_drop: int = 0
    docs_wrongly_kept: int = 0
    """Documents labelled drop whole that the profile kept (in part)."""
    reasons: Counter[str] = field(default_factory=Counter)
    """Why documents with something to keep were dropped: filter rule -> documents."""
    worst: list[tuple[str, int, int]] = field(default_factory=list)
    """(id, wrongly dropped, wrongly kept) per document with an error, largest first."""

    def frac(self, n: int, d: int) -> float:
        return n / d if d else 0.0

    @property
    def wrongly_dropped_frac(self) -> float:
        """Of the characters that should be kept."""
        return self.frac(self.wrongly_dropped, self.chars_should_keep)

    @property
    def wrongly_kept_frac(self) -> float:
        """Of the characters that should be dropped."""
        return self.frac(self.wrongly_kept, self.chars - self.chars_should_keep)


def _line_set(spec: str, n: int) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if not 1 <= lo <= hi <= n:
            raise ValueError(f"line range {part!r} is outside 1..{n}")
        out.update(range(lo, hi + 1))
    return out


def load_labelled(root: Path) -> list[LabelledDoc]:
    """The labelled sample under `root` (texts.jsonl and labels.txt); every text must have exactly one label."""
    texts = {}
    with open(root / "texts.jsonl", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            texts[d["id"]] = d
    labels: dict[str, str] = {}
    for raw in (root / "labels.txt").read_text(encoding="utf-8").splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        m = _LABEL.match(raw)
        if m is None or m["id"] not in texts or m["id"] in labels:
            raise ValueError(f"bad, unknown or repeated label line: {raw!r}")
        labels[m["id"]] = raw
    missing = sorted(set(texts) - set(labels))
    if missing:
        raise ValueError(f"documents without a label: {missing}")
    docs = []
    for doc_id, d in texts.items():
        m = _LABEL.match(labels[doc_id])
        assert m is not None
        n = d["text"].count("\n") + 1
        if m["lines"]:
            dropped = _line_set(m["lines"], n)
            keep = tuple(i not in dropped for i in range(1, n + 1))
        else:
            keep = (m["verdict"] == "keep",) * n
        docs.append(LabelledDoc(id=doc_id, profile=d["profile"], origin=d["origin"], text=d["text"], keep=keep))
    return docs


def kept_lines(text: str, out: str | None) -> list[bool]:
    """Which lines of `text` survive in `out` (None: the document was dropped)."""
    return [False] * (text.count("\n") + 1) if out is None else filters_kept_lines(text, out)


def score(docs: list[LabelledDoc], filters: tuple[str, ...], cfg: FiltersConfig | None = None,
          norm: NormalizeConfig | None = None) -> Score:
    """Run `filters` (after `norm`, the build's default normalization) on each document and compare with its
    labels."""
    cfg, norm = cfg or FiltersConfig(), norm or NormalizeConfig()
    s = Score()
    for d in docs:
        text = normalize(d.text, norm)
        if text != d.text and not norm.boilerplate:
            raise ValueError(f"{d.id}: the fixture text is not normalized; re-cut it with make_sample.py")
        reason = binary_reason(d.text, cfg.binary)
        out, reason = (None, reason) if reason else apply_filters(text, filters, cfg) if text.strip() \
            else (None, "empty")
        kept = kept_lines(d.text, normalize(out, NormalizeConfig()) if out is not None and out.strip() else None)
        lens = [len(ln) for ln in d.text.split("\n")]
        wd = sum(n for n, k, lab in zip(lens, kept, d.keep, strict=True) if lab and not k)
        wk = sum(n for n, k, lab in zip(lens, kept, d.keep, strict=True) if k and not lab)
        s.docs += 1
        s.chars += sum(lens)
        s.chars_should_keep += sum(n for n, lab in zip(lens, d.keep, strict=True) if lab)
        s.chars_kept += sum(n for n, k in zip(lens, kept, strict=True) if k)
        s.wrongly_dropped += wd
        s.wrongly_kept += wk
        if any(d.keep):
            s.docs_should_keep += 1
            if not any(kept):
                s.docs_wrongly_dropped += 1
                s.reasons[str(reason)] += 1
        else:
            s.docs_should_drop += 1
            s.docs_wrongly_kept += any(kept)
        if wd or wk:
            s.worst.append((d.id, wd, wk))
    s.worst.sort(key=lambda t: -(t[1] + t[2]))
    return s


def score_profiles(docs: list[LabelledDoc], norm: NormalizeConfig | None = None) -> dict[str, Score]:
    """Each profile scored on the documents labelled for it."""
    return {p: score([d for d in docs if d.profile == p], PROFILES[p], norm=norm)
            for p in sorted({d.profile for d in docs})}
