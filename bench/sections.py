"""Marked blocks that the benches rewrite inside the docs (docs/benchmarks/*.md, docs/CHECKPOINTS.md).

A bench owns the text between `<!-- bench:KEY -->` and `<!-- /bench:KEY -->`: its table, its command line and
whatever else it prints. Everything outside the two markers is the reader's text (the analysis written after a run),
which a rerun keeps. The key is the bench's stable name for its block, so a heading can be reworded, moved to
another level or another file without the bench losing its place.
"""

from __future__ import annotations

import re
from pathlib import Path

_KEY = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")


def markers(key: str) -> tuple[str, str]:
    """The opening and closing marker of the block named `key` (lower-case words joined by '-')."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"bench section key {key!r} must be lower-case letters and digits joined by '-', "
                         "e.g. 'zero-overlap'")
    return f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"


def replace_section(path: Path, key: str, text: str) -> None:
    """Put `text` between the markers of `key` in `path`: in place of the old block, or appended at the end.

    Idempotent: writing the same text twice leaves the file as after the first write. A file holding one marker
    without the other, or a marker twice, is refused rather than guessed at.
    """
    begin, end = markers(key)
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{text.strip(chr(10))}\n{end}"
    counts = (old.count(begin), old.count(end))
    if counts == (0, 0):
        path.write_text(old.rstrip("\n") + "\n\n" + block + "\n")
        return
    if counts != (1, 1) or old.index(begin) > old.index(end):
        raise ValueError(f"{path}: expected one '{begin}' followed by one '{end}', found {counts[0]} and "
                         f"{counts[1]}; repair the markers by hand (or delete both to append a fresh block)")
    start, stop = old.index(begin), old.index(end) + len(end)
    path.write_text(old[:start] + block + old[stop:])
