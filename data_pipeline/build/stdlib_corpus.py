"""The embedded default corpus: the running interpreter's standard library as three text domains.

code  : every `.py` file outside test directories, one document per file;
prose : docstrings (through `ast`) and blocks of consecutive full-line comments, one document
        per docstring or comment block — real English written by programmers;
tests : every `.py` file under a `test`/`tests`/`idle_test` directory, one document per file.

Real text with real duplicates (license headers, boilerplate, vendored copies), so filters and dedup have
something to do, and no download is ever needed (docs/DATA.md, `kind: stdlib`).
"""

from __future__ import annotations

import ast
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from multiprocessing import get_context
from pathlib import Path

DOMAINS = ("code", "prose", "tests")
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
# Directories that hold installed third-party code or deliberately broken inputs, not the standard library.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "bad_coding", "lib2to3_data"})
_MIN_PROSE_CHARS = 40
_COMMENT_LINE = re.compile(r"^\s*#+(.*)$")


def stdlib_root() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_identity() -> dict[str, str]:
    """What the corpus depends on: the stdlib path and the exact interpreter version (part of cache keys)."""
    return {"stdlib": str(stdlib_root()), "python": sys.version}


def list_stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """All standard-library `.py` files as `(domain, path)` with domain `code` or `tests`, sorted by path."""
    root = root or stdlib_root()
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        parts = set(Path(dirpath).relative_to(root).parts)
        domain = "tests" if parts & _TEST_DIRS else "code"
        out.extend((domain, Path(dirpath) / f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(out, key=lambda item: str(item[1]))


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a few stdlib test files are deliberately invalid
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= _MIN_PROSE_CHARS:
                found.append(doc)
    return found


def _comment_blocks(source: str) -> list[str]:
    """Runs of full-line comments on consecutive lines, joined, with the leading '#' stripped.

    A line-level scan rather than `tokenize`: tokenize costs as much as the whole `ast` pass, and inline
    comments (after code) are mostly too short to be prose anyway.
    """
    blocks: list[list[str]] = []
    previous = False
    for line in source.split("\n"):
        match = _COMMENT_LINE.match(line)
        if match is None:
            previous = False
            continue
        if previous:
            blocks[-1].append(match.group(1).strip())
        else:
            blocks.append([match.group(1).strip()])
        previous = True
    joined = ("\n".join(b).strip() for b in blocks)
    return [b for b in joined if len(b) >= _MIN_PROSE_CHARS and not b.startswith("!")]


def _extract_file(item: tuple[str, str]) -> tuple[str, str | None, list[str]]:
    """(domain, file text or None when unreadable, prose documents) for one file; runs in a worker."""
    domain, path = item
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return domain, None, []
    return domain, text, _docstrings(text) + _comment_blocks(text)


def iter_stdlib_documents(workers: int = 2, root: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield `(domain, text)` for the whole standard library, in a deterministic order.

    Args:
        workers: Processes parsing files (`ast` costs ~0.25 s/MB on one core).
        root: Standard-library directory; the running interpreter's by default.
    """
    items = [(d, str(p)) for d, p in list_stdlib_files(root)]
    if workers > 1:
        from data_pipeline.build.workers import pool_worker

        with get_context("fork").Pool(workers, initializer=pool_worker) as pool:  # its exit SIGTERMs the workers
            results = list(pool.imap(_extract_file, items, chunksize=16))
    else:
        results = [_extract_file(it) for it in items]
    for domain, text, prose in results:
        if text is None:
            continue
        yield domain, text
        for doc in prose:
            yield "prose", doc
