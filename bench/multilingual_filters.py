"""The `docs` profile on real translated text from the machine, per language: characters kept with the
language-aware units (data_pipeline/text_units.py) against whitespace words (the rule before, measured in the same
run by swapping the units for `str.split`). With `--dedup`, near-copy recall per language: each document and a copy
with 2% of its non-ASCII letters replaced by other letters of the document (3 seeds), through near dedup's default
(20 x 5 bands, verification at 0.75), with per-character shingles and with the words before (no document rewritten).

Text: the gettext catalogues under /usr/share/locale (consecutive translated messages of one catalogue joined
into documents of about 500 characters, as tests/fixtures/multilingual/make_sample.py makes them, without format
strings) and the translated man pages under /usr/share/man/<lang> (each page rendered by `man -l`, one document).
Nothing is written by the project.

    PYTHONPATH=. python bench/multilingual_filters.py [--man] [--dedup] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import gettext
import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py`: bench.* from the root

from bench.dedup_eval import replace_letters
from data_pipeline import text_units
from data_pipeline.build import filters, minhash, shingles
from data_pipeline.build.dedup import near_dedup
from data_pipeline.build.filters import FiltersConfig, apply_filters, resolve_filters
from data_pipeline.build.normalize import NormalizeConfig, normalize

LOCALES = ("zh_CN", "zh_TW", "ja", "ko", "th", "km", "my", "ru", "ar")
CHARS = 500


def catalogue_messages(locale: str, root: Path = Path("/usr/share/locale")) -> list[tuple[str, str]]:
    """(catalogue, translated message) of every catalogue of `locale` but the ISO code lists, messages of at least
    30 characters, in catalogue and message-id order."""
    out = []
    for mo in sorted((root / locale / "LC_MESSAGES").glob("*.mo")):
        if mo.name.startswith("iso_"):  # names of countries and languages, not prose
            continue
        try:
            with open(mo, "rb") as f:
                cat = gettext.GNUTranslations(f)._catalog  # type: ignore[attr-defined]
        except (UnicodeDecodeError, OSError):
            continue
        for k, v in sorted(cat.items(), key=lambda kv: str(kv[0])):
            if isinstance(k, str) and k and isinstance(v, str) and v != k and len(v) >= 30 and "\t" not in v:
                out.append((mo.stem, v.strip()))
    return out


def ascii_share(text: str) -> float:
    letters = [ch for ch in text if ch.isalpha()]
    return sum(ch.isascii() for ch in letters) / max(1, len(letters))


def catalogue_documents(msgs: list[tuple[str, str]], lo: float = 0.0, hi: float = 1.0,
                        chars: int = CHARS) -> list[tuple[str, str]]:
    """(catalogue, document): consecutive messages of one catalogue whose ASCII share of letters is in [lo, hi],
    without format strings, joined by newlines into documents of about `chars` characters."""
    docs: list[tuple[str, str]] = []
    cur: list[str] = []
    cat = ""
    for pkg, text in msgs:
        if not lo <= ascii_share(text) <= hi or "%" in text or "{" in text:
            continue
        if pkg != cat:
            cur, cat = [], pkg
        cur.append(text)
        if sum(map(len, cur)) >= chars:
            docs.append((pkg, "\n".join(cur)))
            cur = []
    return docs


def man_pages(locale: str, root: Path = Path("/usr/share/man")) -> Iterator[str]:
    """Every translated man page of `locale`, rendered as a terminal shows it (80 columns)."""
    env = {**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "0"}
    for page in sorted((root / locale).glob("man*/*")):
        if page.is_symlink():
            continue
        try:  # no terminal, no pager; a page that hangs its formatter is skipped
            out = subprocess.run(["man", "-P", "cat", "-l", str(page)], capture_output=True, env=env, check=False,
                                 stdin=subprocess.DEVNULL, timeout=20).stdout
        except subprocess.TimeoutExpired:
            continue
        text = subprocess.run(["col", "-b"], input=out, capture_output=True, check=False).stdout.decode("utf-8",
                                                                                                       "replace")
        if text.strip():
            yield text


def kept(docs: list[str]) -> tuple[int, int, Counter[str]]:
    """(characters in, characters the docs profile keeps, documents dropped per rule), after normalization."""
    names, cfg, norm = resolve_filters(None, "docs"), FiltersConfig(), NormalizeConfig()
    total = out = 0
    reasons: Counter[str] = Counter()
    for doc in docs:
        text = normalize(doc, norm)
        result, why = apply_filters(text, names, cfg)
        total += len(text)
        out += len(result or "")
        if why:
            reasons[why] += 1
    return total, out, reasons


def whitespace_words(run: Callable[[], Any]) -> Any:
    """`run()` with every rule counting whitespace tokens (the units before text_units)."""
    words, mean = text_units.words, filters.mean_word_length
    text_units.words = lambda text, units=None: text.split()  # type: ignore[assignment]
    filters.mean_word_length = lambda ws, min_share=0.5: sum(map(len, ws)) / max(1, len(ws))  # type: ignore[assignment]
    try:
        return run()
    finally:
        text_units.words, filters.mean_word_length = words, mean


def near_copies(docs: list[str], seeds: int = 3) -> tuple[int, int, int]:
    """(pairs, pairs found — the copy or the original removed for the other —, documents removed for another)."""
    n, found, wrong = len(docs), 0, 0
    for seed in range(seeds):
        rng = random.Random(seed)
        res = near_dedup(docs + [replace_letters(t, rng) for t in docs], minhash.MinHashConfig())
        removed = np.flatnonzero(~res.keep)
        found += sum(int(res.cluster[i] % n == i % n) for i in removed)
        wrong += sum(int(res.cluster[i] % n != i % n) for i in removed)
    return seeds * n, found, wrong


def words_before(run: Callable[[], Any]) -> Any:
    """`run()` with near dedup's words as before text_units (no text rewritten per character)."""
    table = shingles.unspaced_table
    shingles.unspaced_table = lambda: np.zeros(1, dtype=bool)  # type: ignore[assignment]
    try:
        return run()
    finally:
        shingles.unspaced_table = table


def dedup_rows() -> None:
    print("| language | text | documents | recall (characters) | removed wrongly | recall (words before) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for locale in LOCALES:
        msgs = catalogue_messages(locale)
        for kind, lo, hi in (("prose", 0.0, 0.1), ("mixed", 0.15, 0.5)):
            docs = [d for _, d in catalogue_documents(msgs, lo, hi)][:200]
            if len(docs) < 10:
                continue
            pairs, found, wrong = near_copies(docs)
            _, found_ws, _ = words_before(functools.partial(near_copies, docs))
            print(f"| {locale} | {kind} | {len(docs)} | {found / pairs:.3f} | {wrong} | {found_ws / pairs:.3f} |")
            sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--man", action="store_true", help="also the translated man pages (~1 s a page)")
    parser.add_argument("--dedup", action="store_true", help="near-copy recall per language instead")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.dedup:
        dedup_rows()
        return
    rows = []

    def corpora() -> Iterator[tuple[str, str, list[str]]]:
        for locale in LOCALES:
            msgs = catalogue_messages(locale)
            yield locale, "catalogue prose", [d for _, d in catalogue_documents(msgs, 0.0, 0.1)]
            yield locale, "catalogue, any", [d for _, d in catalogue_documents(msgs)]
            if args.man and (Path("/usr/share/man") / locale).is_dir():
                yield locale, "man pages", list(man_pages(locale))

    print("| language | text | documents | characters | kept (units) | kept (whitespace words) | dropped by (units) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for locale, kind, docs in corpora():
        if not docs:
            continue
        total, out, reasons = kept(docs)
        _, out_ws, reasons_ws = whitespace_words(functools.partial(kept, docs))
        rows.append({"locale": locale, "text": kind, "documents": len(docs), "characters": total, "kept": out,
                     "kept_whitespace": out_ws, "reasons": dict(reasons), "reasons_whitespace": dict(reasons_ws)})
        why = ", ".join(f"{r} {n}" for r, n in reasons.most_common()) or "-"
        print(f"| {locale} | {kind} | {len(docs):,} | {total:,} | {out / total:.1%} | {out_ws / total:.1%} | {why} |")
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
