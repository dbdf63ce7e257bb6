"""What a corpus is written in, for the tokenizer: the sentencepiece `character_coverage` its scripts call for, and
tokens per character by language, told from the script (`data stats`).

Sentencepiece makes a piece of every character that, most frequent first, covers `character_coverage` of the
training sample; the rest fall back to bytes. Its authors advise 0.9995 for languages with rich character sets
(Chinese, Japanese) and 1.0 for the others: at 1.0 a sample with Chinese in it needs thousands of single-character
pieces ("Vocabulary size is smaller than required_chars"), at 0.9995 an alphabetic corpus loses its rare letters
to byte fallback for nothing.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence, Sized

from data_pipeline.text_units import script_of

RICH_SHARE = 0.01
"""Share of a sample's characters in Han, kana or Hangul from which the sample is treated as CJK (0.9995)."""
RICH_COVERAGE = 0.9995
"""Sentencepiece's advice for Chinese and Japanese."""
MAX_CHAR_SHARE = 0.25
"""At coverage 1.0 every distinct character is a piece; above this share of the vocabulary's pieces beyond the
byte and special ones, 0.9995 is chosen."""
BYTE_AND_SPECIAL_PIECES = 256 + 3 + 2
"""Byte fallback, unk/bos/eos, and the newline and tab pieces (`tokenizer.USER_SYMBOLS`)."""
_LABELS = {"LATIN": "Latin", "CYRILLIC": "Cyrillic", "GREEK": "Greek", "ARABIC": "Arabic", "HEBREW": "Hebrew",
           "DEVANAGARI": "Devanagari", "THAI": "Thai", "LAO": "Lao", "KHMER": "Khmer", "MYANMAR": "Myanmar",
           "HANGUL": "Korean", "GEORGIAN": "Georgian", "ARMENIAN": "Armenian", "BENGALI": "Bengali",
           "TAMIL": "Tamil", "ETHIOPIC": "Ethiopic"}


def _is_hangul(ch: str) -> bool:
    return "\uac00" <= ch <= "\ud7a3" or "\u1100" <= ch <= "\u11ff" or "\u3130" <= ch <= "\u318f"


def choose_character_coverage(lines: Sequence[str], vocab_size: int) -> tuple[float, str]:
    """(coverage, why) for a sentencepiece sample: 0.9995 when at least `RICH_SHARE` of its characters are Han,
    kana or Hangul, or when its distinct characters would take more than `MAX_CHAR_SHARE` of the vocabulary's
    pieces beside the byte and special ones (a small vocabulary, or a few documents in many scripts); 1.0
    otherwise."""
    counts: Counter[str] = Counter()
    for line in lines:
        counts.update(line)
    for ws in (" ", "\n", "\t", "\r"):
        counts.pop(ws, None)
    total = sum(counts.values()) or 1
    rich = sum(n for ch, n in counts.items() if _is_hangul(ch) or script_of(ch) == "cjk")
    if rich >= RICH_SHARE * total:
        return RICH_COVERAGE, f"{rich / total:.1%} of the sample's characters are Chinese, Japanese or Korean"
    room = vocab_size - BYTE_AND_SPECIAL_PIECES
    if len(counts) > MAX_CHAR_SHARE * room:
        return RICH_COVERAGE, (f"its {len(counts):,} distinct characters would take over {MAX_CHAR_SHARE:.0%} of the "
                               f"{room:,} pieces vocab_size {vocab_size:,} leaves beside the byte and special ones")
    return 1.0, f"{len(counts):,} distinct characters, {rich / total:.2%} Chinese, Japanese or Korean"


def language_of(text: str, max_chars: int = 2000) -> str:
    """The language of a document as its letters' script tells it: Japanese (any kana), Chinese (Han without
    kana), Korean (Hangul), else the script's name (Latin, Cyrillic, Arabic, Thai, ...); "other" without letters."""
    counts: Counter[str] = Counter()
    kana = 0
    for ch in text[:max_chars]:
        if not ch.isalpha():
            continue
        if script_of(ch) == "cjk":
            kana += "\u3040" <= ch <= "\u30ff" or "\uff66" <= ch <= "\uff9f"
            counts["cjk"] += 1
        else:
            name = unicodedata.name(ch, "")
            counts[_LABELS.get(name.split(" ", 1)[0], "Korean" if _is_hangul(ch) else "other")] += 1
    if not counts:
        return "other"
    top = counts.most_common(1)[0][0]
    if top == "cjk":
        return "Japanese" if kana >= 0.05 * counts["cjk"] else "Chinese"
    return top


def tokens_by_language(texts: Iterable[str], encode: Callable[[list[str]], Sequence[Sized]]
                       ) -> dict[str, dict[str, int]]:
    """Per language (`language_of`): documents, characters and tokens of `texts` under `encode` (EOS not
    counted)."""
    texts = list(texts)
    out: dict[str, dict[str, int]] = {}
    for text, ids in zip(texts, encode(texts), strict=True):
        row = out.setdefault(language_of(text), {"documents": 0, "characters": 0, "tokens": 0})
        row["documents"] += 1
        row["characters"] += len(text)
        row["tokens"] += len(ids)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["characters"]))
