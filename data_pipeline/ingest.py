"""Ingest: stream documents out of raw sources, counting malformed records by reason instead of crashing.

Formats: jsonl, jsonl.gz, jsonl.zst (one JSON object per line), parquet (pyarrow, batch by batch), Hugging Face
datasets (a `save_to_disk` directory, or local data files read by `datasets` in streaming mode) and plain-text
trees (one document per file). Nothing is loaded whole: every reader yields one record at a time.

A record is either a document (`text`) or a malformed one (`reason`, `raw` for the rejects file):
bad_json, not_an_object, missing_field, non_string_field, invalid_utf8, unreadable_file.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from framework.errors import ConfigError, DataError

Format = Literal["auto", "jsonl", "parquet", "hf", "text"]
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst", ".ndjson")


@dataclass(frozen=True)
class Record:
    """One input record: a document (`text` set) or a malformed record (`reason` set)."""

    text: str | None
    where: str
    """file:line (or file:row) — for the rejects file and error messages."""
    reason: str | None = None
    raw: str | None = None


def detect_format(path: Path) -> Format:
    """Guess a source's format from its path (a directory of parquet/jsonl files counts as that format)."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file() or \
                (path / "dataset_dict.json").is_file():
            return "hf"
        return "text"
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    raise ConfigError(f"cannot tell the format of {str(path)!r} from its name; set the source's format to one of "
                      f"jsonl, parquet, hf, text")


def _open_binary(path: Path) -> IO[bytes]:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith(".zst"):
        import zstandard

        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


def _field_text(obj: Any, field: str, where: str, raw: str) -> Record:
    if not isinstance(obj, dict):
        return Record(None, where, "not_an_object", raw)
    value = obj.get(field)
    if value is None:
        return Record(None, where, "missing_field", raw)
    if not isinstance(value, str):
        return Record(None, where, "non_string_field", raw)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates written as \\udxxx escapes
        return Record(None, where, "invalid_utf8", raw)
    return Record(value, where)


def read_jsonl(path: Path, field: str) -> Iterator[Record]:
    """One record per line of a (compressed) JSON-lines file; blank lines are skipped."""
    with _open_binary(path) as f:
        for n, line in enumerate(f, 1):
            where = f"{path}:{n}"
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                yield Record(None, where, "invalid_utf8", line.decode("utf-8", "replace")[:2000])
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                yield Record(None, where, "bad_json", text[:2000])
                continue
            yield _field_text(obj, field, where, text[:2000])


def read_parquet(path: Path, field: str, batch_rows: int = 1024) -> Iterator[Record]:
    """One record per row of a parquet file, read batch by batch (only the text column)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path} has no column {field!r} (columns: {pf.schema_arrow.names}); set the source's "
                        f"text_field to the column holding the text")
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=[field]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield _field_text({field: value}, field, f"{path}:{row}", repr(value)[:2000])


def read_hf(path: Path, field: str) -> Iterator[Record]:
    """Records of a Hugging Face dataset saved with `save_to_disk` (every split, in name order)."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    splits = [ds[k] for k in sorted(ds)] if isinstance(ds, datasets.DatasetDict) else [ds]
    for split in splits:
        if field not in split.column_names:
            raise DataError(f"{path} has no column {field!r} (columns: {split.column_names}); set text_field")
        for i, value in enumerate(split.select_columns([field]).iter(batch_size=1)):
            v = value[field][0]
            yield _field_text({field: v}, field, f"{path}:{i + 1}", repr(v)[:2000])


def read_hf_files(path: Path, field: str, builder: str) -> Iterator[Record]:
    """Local data files read through `datasets.load_dataset(builder, data_files=..., streaming=True)`."""
    import datasets

    ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    for i, row in enumerate(ds):
        yield _field_text(row, field, f"{path}:{i + 1}", repr(row)[:2000])


def list_text_files(root: Path, glob: str) -> list[Path]:
    """Files of a text tree matching `glob`, sorted (deterministic document order)."""
    return sorted(p for p in root.rglob(glob) if p.is_file())


def read_text_tree(root: Path, glob: str = "*") -> Iterator[Record]:
    """One document per file under `root` matching `glob`."""
    for path in list_text_files(root, glob):
        try:
            data = path.read_bytes()
        except OSError as err:
            yield Record(None, str(path), "unreadable_file", str(err))
            continue
        try:
            yield Record(data.decode("utf-8"), str(path))
        except UnicodeDecodeError:
            yield Record(None, str(path), "invalid_utf8", data[:2000].decode("utf-8", "replace"))


def input_files(path: Path, fmt: Format) -> list[Path]:
    """The files a jsonl/parquet source reads: the path itself, or its matching files when it is a directory."""
    if not path.is_dir():
        return [path]
    want = (".parquet",) if fmt == "parquet" else _JSONL_SUFFIXES
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(want))


def read_records(path: str | Path, fmt: Format = "auto", field: str = "text", glob: str = "*",
                 hf_builder: str | None = None) -> Iterator[Record]:
    """Stream every record of a source.

    Args:
        path: A file or directory.
        fmt: jsonl / parquet / hf / text, or auto (from the path).
        field: The text field (jsonl key, parquet or dataset column).
        glob: Text trees: which files are documents.
        hf_builder: Read `path` through `datasets.load_dataset(hf_builder, data_files=path)` instead
            (e.g. "json", "parquet", "text").
    """
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise ConfigError(f"source path {str(p)!r} does not exist; fix the source's path")
    if hf_builder is not None:
        yield from read_hf_files(p, field, hf_builder)
        return
    fmt = detect_format(p) if fmt == "auto" else fmt
    if fmt == "text":
        yield from read_text_tree(p, glob)
    elif fmt == "hf":
        yield from read_hf(p, field)
    else:
        for f in input_files(p, fmt):
            yield from (read_parquet(f, field) if fmt == "parquet" else read_jsonl(f, field))
