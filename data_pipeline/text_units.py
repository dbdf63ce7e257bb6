"""Text units: what the filter rules count as words and what near dedup shingles, in any script.

Most scripts put spaces between words, and a whitespace token is a word. Han (Chinese, Japanese kanji), Hiragana,
Katakana, Thai, Lao, Khmer and Myanmar do not: a run of them between punctuation is a clause, not a word, so a rule
that counts words sees one 15-character "word" where a reader sees eight, and a dedup shingle of five such "words"
spans a paragraph. Here a run of those scripts is cut into one unit per character (a base character with the
combining marks that follow it: Thai vowel signs and tone marks, Japanese voicing marks, variation selectors), or
into words by a segmenter the user names (`UnitsConfig.segmenters`, e.g. jieba for Chinese, pythainlp for Thai);
the rest of the text is split at whitespace as before, span by span, so a mixed-script page is handled in one pass.

Text holding none of those scripts gives exactly the units it gave before (whitespace tokens for the filters,
the word bytes of `build/shingles.py` for the shingles): English outputs are byte for byte unchanged.
"""

from __future__ import annotations

import functools
import importlib
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from framework.base.errors import ConfigError

# Blocks of the scripts written without spaces, by the group a segmenter is named for ("cjk": Han and kana, which
# Japanese mixes in one run; a Chinese or Japanese segmenter takes the whole run).
UNSPACED: dict[str, tuple[tuple[int, int], ...]] = {
    "cjk": ((0x2E80, 0x2FDF), (0x3005, 0x3007), (0x3021, 0x3029), (0x3031, 0x3035), (0x3038, 0x303C),
            (0x3040, 0x309F), (0x30A0, 0x30FA), (0x30FC, 0x30FF), (0x31F0, 0x31FF), (0x3400, 0x4DBF),
            (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF66, 0xFF9F), (0x20000, 0x3134F)),
    "thai": ((0x0E00, 0x0E7F),),
    "lao": ((0x0E80, 0x0EFF),),
    "khmer": ((0x1780, 0x17FF), (0x19E0, 0x19FF)),
    "myanmar": ((0x1000, 0x109F), (0xA9E0, 0xA9FF), (0xAA60, 0xAA7F)),
}
# Punctuation and spaces of East Asian text (ideographic space and full stop, brackets, fullwidth forms): units of
# their own for the filters (as a lone "—" is a whitespace token), separators for the shingles (as ASCII
# punctuation is).
_PUNCT_BLOCKS = ((0x3000, 0x303F), (0x30FB, 0x30FB), (0xFE10, 0xFE1F), (0xFE30, 0xFE4F), (0xFF01, 0xFF65))
_VARIATION = ((0xFE00, 0xFE0F), (0xE0100, 0xE01EF))


def _ranges(cps: list[int]) -> str:
    """A regex character-class body for the code points `cps` (sorted), as ranges."""
    out, i = [], 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        out.append(re.escape(chr(cps[i])) + ("" if i == j else "-" + re.escape(chr(cps[j]))))
        i = j + 1
    return "".join(out)


def _classes() -> tuple[dict[str, str], str, str]:
    """(per group the class of its base characters, the class of combining marks, the class of punctuation)."""
    marks, bases = set(), {}
    for group, blocks in UNSPACED.items():
        base, body = [], ""
        for lo, hi in blocks:
            if hi - lo > 0x400:  # the ideograph blocks: every code point (an unassigned one is a future ideograph)
                body += re.escape(chr(lo)) + "-" + re.escape(chr(hi))
                continue
            for cp in range(lo, hi + 1):
                cat = unicodedata.category(chr(cp))
                if cat.startswith("M"):
                    marks.add(cp)
                elif cat != "Cn":
                    base.append(cp)
        bases[group] = _ranges(base) + body
    marks.update(cp for lo, hi in _VARIATION for cp in range(lo, hi + 1))
    punct = [cp for lo, hi in _PUNCT_BLOCKS for cp in range(lo, hi + 1)
             if unicodedata.category(chr(cp))[0] in "PSZ" and not any(lo2 <= cp <= hi2 for b in UNSPACED.values()
                                                                       for lo2, hi2 in b)]
    return bases, _ranges(sorted(marks)), _ranges(punct)


_BASES, _MARK, _PUNCT = _classes()
_BASE = "".join(_BASES.values())
_HAS = re.compile(f"[{_BASE}{_PUNCT}]")
"""Any character that makes the units differ from whitespace tokens."""
_RUN = re.compile("|".join(f"(?P<{g}>[{b}][{b}{_MARK}]*)" for g, b in _BASES.items()))
"""A maximal run of one group's characters (with their marks)."""
_CHAR = re.compile(f"[{_BASE}][{_MARK}]*|.", re.DOTALL)
"""One unit of a run cut per character: a base character and the marks after it."""
_TOKEN = re.compile(r"\S+")
_SHINGLE_SPLIT = re.compile(f"([{_BASE}][{_MARK}]*)|[{_PUNCT}]+")

Segmenter = Callable[[str], list[str]]
KNOWN_SEGMENTERS = {"jieba": "jieba:lcut", "pythainlp": "pythainlp.tokenize:word_tokenize",
                    "kiwipiepy": "kiwipiepy:Kiwi"}
"""Short names for segmenters of the field; any other is given as "module:function" (the function takes a run of
text and returns its words)."""


@dataclass(kw_only=True, frozen=True)
class UnitsConfig:
    """How the filter rules cut runs of unspaced scripts into words."""

    segmenters: dict[str, str] = field(default_factory=dict)
    """By group (cjk, thai, lao, khmer, myanmar): a segmenter, "jieba", "pythainlp" or "module:function"; a group
    not named is cut per character. Near dedup always shingles per character: a segmenter's words around an edited
    character change with the edit, a character's do not."""

    def validate(self) -> None:
        unknown = sorted(set(self.segmenters) - set(UNSPACED))
        if unknown:
            raise ConfigError(f"filters.units.segmenters names groups {unknown}; the groups are {sorted(UNSPACED)}")
        for group, name in self.segmenters.items():
            load_segmenter(name, group)


@functools.lru_cache(maxsize=16)
def load_segmenter(name: str, group: str = "cjk") -> Segmenter:
    """The segmenter named `name` ("jieba", "pythainlp", or "module:function")."""
    spec = KNOWN_SEGMENTERS.get(name, name)
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"filters.units.segmenters.{group} = {name!r} is neither one of {sorted(KNOWN_SEGMENTERS)} "
                          f"nor 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"filters.units.segmenters.{group} = {name!r}: cannot load {spec} ({e}); install it "
                          f"(pip install {module.split('.')[0]}) or remove the entry to cut per character") from e
    if name == "kiwipiepy":
        kiwi = fn()
        return lambda run: [t.form for t in kiwi.tokenize(run)]
    return fn  # type: ignore[no-any-return]


def has_unspaced(text: str) -> bool:
    """Whether `text` holds a character of an unspaced script or East Asian punctuation (units differ from
    whitespace tokens)."""
    return not text.isascii() and _HAS.search(text) is not None


def words(text: str, units: UnitsConfig | None = None) -> list[str]:
    """The units the filter rules count as words: whitespace tokens, with runs of unspaced scripts cut per
    character (or by the group's segmenter) and East Asian punctuation as units of its own."""
    if not has_unspaced(text):
        return _TOKEN.findall(text)
    segs = units.segmenters if units is not None else {}
    out: list[str] = []
    pos = 0
    for m in _RUN.finditer(text):
        out += _TOKEN.findall(_spaced_punct(text[pos:m.start()]))
        run, group = m.group(), m.lastgroup or "cjk"
        if group in segs:
            out += [w for w in (s.strip() for s in load_segmenter(segs[group], group)(run)) if w]
        else:
            out += _CHAR.findall(run)
        pos = m.end()
    out += _TOKEN.findall(_spaced_punct(text[pos:]))
    return out


_PUNCT_RE = re.compile(f"[{_PUNCT}]")


def _spaced_punct(text: str) -> str:
    return _PUNCT_RE.sub(r" \g<0> ", text) if not text.isascii() else text


def is_segmented(word: str) -> bool:
    """Whether a unit comes from an unspaced script or East Asian punctuation (its length is not a word length)."""
    return not word.isascii() and _HAS.search(word) is not None


def shingle_text(text: str) -> str:
    """`text` as near dedup's word bytes should see it: every character of an unspaced script (with its marks)
    between spaces, East Asian punctuation a space; unchanged when there is none."""
    if not has_unspaced(text):
        return text
    return _SHINGLE_SPLIT.sub(r" \1 ", text)


UNSPACED_TABLE_SIZE = 0x31351
"""Code points `unspaced_table` covers: past the last ideograph block, whose last entry (no character) is False."""


@functools.lru_cache(maxsize=1)
def unspaced_table() -> np.ndarray:
    """For every code point below `UNSPACED_TABLE_SIZE`, whether it makes `has_unspaced` true (a base character of
    an unspaced script or East Asian punctuation): a look-up for code points decoded in numpy (`build/shingles.py`)."""
    table = np.zeros(UNSPACED_TABLE_SIZE, dtype=bool)
    for lo, hi in [b for blocks in UNSPACED.values() for b in blocks] + list(_PUNCT_BLOCKS):
        table[lo:hi + 1] = [_HAS.match(chr(cp)) is not None for cp in range(lo, hi + 1)]
    return table


def mean_word_length(ws: list[str], min_share: float = 0.5) -> float | None:
    """Mean length of the whitespace-delimited words among `ws`, or None when they are fewer than `min_share` of
    the units (text mostly in unspaced scripts has no word length to measure: a character is not a word)."""
    spaced = [w for w in ws if not is_segmented(w)]
    if not spaced or len(spaced) < min_share * len(ws):
        return None
    return sum(map(len, spaced)) / len(spaced)


def script_of(ch: str) -> str:
    """The group of an unspaced-script character ("cjk", "thai", ...), or "" for any other."""
    m = _RUN.match(ch)
    return (m.lastgroup or "") if m else ""
