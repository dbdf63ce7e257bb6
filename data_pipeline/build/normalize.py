"""Normalization applied to every document before filters and dedup (so hashes compare like with like).

Unicode NFC; line endings to "\\n"; control characters other than newline and tab removed; trailing
whitespace on each line removed; runs of more than two blank lines shortened; optional boilerplate-line
removal (cookie/consent banners, "all rights reserved", share/subscribe lines — C4/FineWeb-style). Leading
whitespace is kept: indentation is meaning in code.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import xxhash

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\ufeff]")
_TRAILING_WS = re.compile(r"[ \t\u00a0\u3000]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{4,}")
_BOILERPLATE = re.compile(
    r"(cookie|privacy policy|terms of (use|service)|all rights reserved|javascript|subscribe to our|"
    r"sign up for our newsletter|share (this|on) (facebook|twitter)|click here to|accept (all )?cookies)",
    re.IGNORECASE)


@dataclass(kw_only=True, frozen=True)
class NormalizeConfig:
    nfc: bool = True
    """Unicode NFC, so composed and decomposed spellings hash the same."""
    strip_control: bool = True
    boilerplate: bool = False
    """Drop short lines (< 200 chars) matching common web boilerplate (off by default: it would touch code)."""


def remove_boilerplate_lines(text: str) -> str:
    """Text without short lines that look like web boilerplate."""
    return "\n".join(line for line in text.split("\n") if len(line) >= 200 or not _BOILERPLATE.search(line))


def normalize(text: str, cfg: NormalizeConfig) -> str:
    """The normalized form of `text` (see the module docstring); may be empty."""
    if cfg.nfc:
        text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if cfg.strip_control:
        text = _CONTROL.sub("", text)
    text = _TRAILING_WS.sub("", text)
    if cfg.boilerplate:
        text = remove_boilerplate_lines(text)
    text = _BLANK_RUNS.sub("\n\n\n", text)
    return text.strip("\n")


def doc_hash(text: str) -> int:
    """64-bit content hash of a normalized document (exact dedup and the held-out split)."""
    return int(xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass")))
