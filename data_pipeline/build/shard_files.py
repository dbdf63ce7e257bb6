"""The files of an ingest shard under `<output_dir>/work/ingest/<source>/`: the jsonl of normalized, kept documents
("t") with where each came from ("w"), their hashes, and each line's byte offset; readers by row and the writer.
Every file is written under a temporary name and renamed, so a killed build leaves no half-written output.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.normalize import doc_hash
from framework.base.errors import DataError

UNITS = "units.json"
"""ingest/<source>/units.json: per ingest unit, the base of its line numbers (`line_base`, see _line_bases)."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}.npy")
    np.save(tmp, arr)
    tmp.replace(path)


LINE_OFFSETS = ".offsets.npy"
"""Beside each ingest shard `shard-U-K.jsonl`: the byte offset of each of its lines and of its end (uint64,
lines + 1), so a few rows are read by offset instead of by scanning the shard up to the last of them."""


def read_shard_rows(path: Path, rows: Sequence[int] | None, read: Any) -> list[Any]:
    """`read(json)` of every line of an ingest shard, or of the given rows only (sorted, distinct): only those
    lines are read, at their offsets (`LINE_OFFSETS`), and decoded (a shard line holds the whole text; decoding
    them all was most of the near stage's time). A shard written before the offsets is scanned line by line."""
    if rows is None:
        with open(path, encoding="utf-8") as f:
            return [read(json.loads(line)) for line in f]
    offsets_path = path.with_name(path.name.replace(".jsonl", LINE_OFFSETS))
    if offsets_path.is_file():
        offsets = np.load(offsets_path, mmap_mode="r")  # only the pages of the rows asked for are read
        if len(rows) and rows[-1] >= len(offsets) - 1:
            raise _past_end(path, rows[-1], len(offsets) - 1)
        picked = np.asarray(rows, dtype=np.int64)
        starts, ends = np.asarray(offsets[picked]).tolist(), np.asarray(offsets[picked + 1]).tolist()
        end = offsets[-1]
        del offsets
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != int(end):
                raise DataError(f"{path} holds {size} bytes but its {offsets_path.name} says {end}: the shard was "
                                f"changed after ingest; delete the build's work/ folder and rebuild")
            return [read(json.loads(os.pread(fd, e - b, b))) for b, e in zip(starts, ends, strict=True)]
        finally:
            os.close(fd)
    out: list[Any] = []
    want = iter(rows)
    nxt, lines = next(want, None), 0
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            lines = i + 1
            if i == nxt:
                out.append(read(json.loads(line)))
                nxt = next(want, None)
                if nxt is None:
                    break
    if nxt is not None:
        raise _past_end(path, nxt, lines)
    return out


def _past_end(path: Path, row: int, lines: int) -> DataError:
    return DataError(f"{path}: row {row} is past the shard's end ({lines} lines); the ingest output is damaged: "
                     f"delete the build's work/ folder and rebuild")


def read_shard_texts(path: Path, rows: Sequence[int] | None = None) -> list[str]:
    """The texts of an ingest shard (of the given sorted rows only, if given)."""
    return read_shard_rows(path, rows, lambda d: d["t"])


def read_shard_where(path: Path, rows: Sequence[int] | None = None) -> list[str]:
    """Where each document of an ingest shard came from (file:line, or the file of a text tree), of the given
    sorted rows only if given. A shard of a byte-range unit stores lines counted from the range's start; the
    source's units.json (written once every unit is done) gives the base that makes them the file's line numbers."""
    bases = path.with_name(UNITS)
    base = json.loads(bases.read_text())["line_base"][int(path.name.split("-")[1])] if bases.is_file() else 0
    return read_shard_rows(path, rows, lambda d: _rebase(d.get("w", "?"), base))


def list_shards(work: Path, stage: str, source: str, suffix: str) -> list[Path]:
    return sorted((work / stage / source).glob(f"shard-*{suffix}"))


class _ShardWriter:
    def __init__(self, out: Path, prefix: str, shard_docs: int) -> None:
        self.out, self.prefix, self.shard_docs, self.k = out, prefix, shard_docs, 0
        self.texts: list[tuple[str, str]] = []

    def add(self, text: str, where: str) -> None:
        self.texts.append((text, where))
        if len(self.texts) == self.shard_docs:
            self.flush()

    def flush(self) -> None:
        if not self.texts:
            return
        name = f"{self.prefix}-{self.k:05d}"
        tmp = self.out / f"{name}.jsonl.tmp"
        lengths = []
        with open(tmp, "wb") as f:  # line by line: the shard's texts are not held twice
            for t, w in self.texts:
                line = (json.dumps({"t": t, "w": w}, ensure_ascii=False) + "\n").encode("utf-8")
                f.write(line)
                lengths.append(len(line))
        offsets = np.zeros(len(lengths) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        save_npy_atomic(self.out / f"{name}{LINE_OFFSETS}", offsets)
        hashes = np.array([doc_hash(t) for t, _ in self.texts], dtype=np.uint64)
        save_npy_atomic(self.out / f"{name}.hash.npy", hashes)
        order = np.argsort(hashes, kind="stable")  # hash-prefix partitions of the exact stage slice this
        save_npy_atomic(self.out / f"{name}.hsort.npy", np.stack([hashes[order], order.astype(np.uint64)]))
        tmp.replace(self.out / f"{name}.jsonl")
        self.k, self.texts = self.k + 1, []


def _rebase(where: str, base: int) -> str:
    """`file:line` of a range unit with its line made the file's (`file`, a file with no line, unchanged)."""
    head, _, line = where.rpartition(":")
    return f"{head}:{int(line) + base}" if base and head and line.isdigit() else where
