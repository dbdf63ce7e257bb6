"""Markdown section replacement shared by the benches that write into docs/BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, heading: str, text: str) -> None:
    """Replace the section of `path` that starts at `heading` (up to the next '## ' heading), or append it.

    Idempotent: writing the same text twice leaves the file as after the first write.
    """
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    body = text.rstrip("\n") + "\n"
    if heading in old:
        start = old.index(heading)
        nxt = old.find("\n## ", start + len(heading))
        new = old[:start] + body + ("\n" + old[nxt + 1:] if nxt != -1 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + body
    path.write_text(new)
