"""Ingest: stream documents out of raw sources, counting malformed records by reason instead of crashing.

Formats: jsonl (`.jsonl`, `.json`, `.ndjson`, each optionally `.gz`/`.zst`/`.bz2`/`.xz`: one JSON object per
line), parquet (pyarrow, batch by batch), Hugging Face datasets (a `save_to_disk` directory — one `split`,
`train` by default — or local data files read by `datasets` in streaming mode) and plain-text trees (one
document per file; compressed files are read decompressed). Nothing is loaded whole: every reader yields one
record at a time.

A record is a document (`text` set) or a malformed one (`reason` set, `raw` for the rejects file). Reasons:
bad_json, json_too_deep, not_an_object, missing_field, non_string_field, invalid_utf8 — one per record;
unreadable_file, corrupt_file, truncated_file — one per file (or per file's unread tail: a compressed file that
ends early keeps the records read before the break and counts the rest as one `truncated_file` record, with the
number of records read in its `raw`). One bad record or file never stops the source.
"""

from __future__ import annotations

import bz2
import json
import lzma
import os
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from framework.base.errors import ConfigError, DataError

Format = Literal["auto", "jsonl", "parquet", "hf", "text"]
COMPRESSED = (".gz", ".zst", ".bz2", ".xz")
_JSONL_EXT = (".jsonl", ".json", ".ndjson")
_JSONL_SUFFIXES = tuple(e + c for e in _JSONL_EXT for c in ("", *COMPRESSED))
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_READ = 1 << 20
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Record:
    """One input record: a document (`text` set) or a malformed record (`reason` set)."""

    text: str | None
    where: str
    """file:line (from 1, as editors count), file:row (parquet and HF datasets: from 0, as `dataset[i]` reads it), or
    the file of a text tree — kept with the document, in rejects and errors."""
    reason: str | None = None
    raw: str | None = None
    note: str | None = None
    """A kept document read with a caveat (e.g. `encoding_fallback`), counted per source."""


class FileError(Exception):
    """A file that cannot be read (further): `reason` is unreadable_file, corrupt_file or truncated_file."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _kind(name: str) -> str:
    name = name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _visible_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(root).parts))


def detect_format(path: Path) -> Format:
    """A source's format from what is there: a file by its extension; a directory holding a saved HF dataset
    is `hf`, else by its files' extensions — all `.jsonl[.gz|.zst|...]`: jsonl, all `.parquet`: parquet, none of
    either: a text tree. A directory mixing kinds is refused with the counts (set `format`, and `glob`)."""
    if path.is_dir():
        if any((path / m).is_file() for m in _HF_MARKERS):
            return "hf"
        kinds = Counter(_kind(p.name) for p in _visible_files(path))
        if not kinds:
            raise ConfigError(f"source directory {str(path)!r} holds no files; fix the source's path")
        if len(kinds) == 1:
            return next(iter(kinds))  # type: ignore[return-value,arg-type]
        raise ConfigError(f"source directory {str(path)!r} mixes file kinds ({dict(sorted(kinds.items()))}); set "
                          f"the source's format (jsonl and parquet read only their own files; text reads the "
                          f"files matching glob)")
    kind = _kind(path.name)
    if kind != "text":
        return kind  # type: ignore[return-value]
    raise ConfigError(f"cannot tell the format of {str(path)!r} from its name; set the source's format to one of "
                      f"jsonl, parquet, hf, text")


def _decompressor(name: str) -> Any:
    """A factory of streaming decompressors (each with `decompress`, `eof`, `unused_data`) for a file name, or
    None for an uncompressed file."""
    if name.endswith(".gz"):
        return lambda: zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    if name.endswith(".zst"):
        import zstandard

        return lambda: zstandard.ZstdDecompressor().decompressobj()
    if name.endswith(".bz2"):
        return bz2.BZ2Decompressor
    if name.endswith(".xz"):
        return lzma.LZMADecompressor
    return None


def _chunks(path: Path) -> Iterator[bytes]:
    make = _decompressor(path.name.lower())
    with open(path, "rb") as raw:
        if make is None:
            while chunk := raw.read(_READ):
                yield chunk
            return
        # Stream by hand (not gzip.open & co): everything up to a break is yielded, so a truncated file keeps the
        # records before it, and a stream that stops mid-frame is noticed (zstd's reader would end silently).
        d, fed = make(), False
        while data := raw.read(_READ):
            while data:
                try:
                    out = d.decompress(data)
                except (OSError, ValueError) as err:  # bz2/lzma report bad data as OSError
                    raise zlib.error(str(err)) from err
                fed = True
                if out:
                    yield out
                if not d.eof:
                    break
                data = d.unused_data  # the next member or frame of a concatenated file
                d, fed = make(), False
        if fed and not d.eof:
            raise EOFError("the compressed stream ends before its end marker")


def read_chunks(path: Path) -> Iterator[bytes]:
    """The (decompressed) bytes of a file in chunks; raises FileError when the file cannot be read to its end."""
    import zstandard

    try:
        yield from _chunks(path)
    except EOFError as err:
        raise FileError("truncated_file", f"{path}: {err}") from err
    except (zlib.error, lzma.LZMAError, zstandard.ZstdError) as err:
        raise FileError("corrupt_file", f"{path}: corrupt compressed data ({err})") from err
    except OSError as err:
        raise FileError("unreadable_file", f"{path}: {err}") from err


def read_lines(path: Path, span: tuple[int, int] | None = None,
               tally: dict[str, int] | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, line without its newline) of a (compressed) file; a leading UTF-8 BOM is dropped.

    With `span` = (a, b), an uncompressed file's lines that start at a byte offset in [a, b): every line belongs to
    exactly one of a file's consecutive spans, and its number counts from the span's first line (1). `tally`
    gets the number of lines read ("lines"), blank ones included, once the file or span is read to its end."""
    if span is not None:
        yield from _span_lines(path, span, tally)
        return
    buf, n = b"", 0
    for chunk in read_chunks(path):
        if n == 0 and not buf and chunk.startswith(_BOM):
            chunk = chunk[len(_BOM):]
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            n += 1
            yield n, line
    if buf:
        n += 1
        yield n, buf
    if tally is not None:
        tally["lines"] = n


def _span_lines(path: Path, span: tuple[int, int], tally: dict[str, int] | None) -> Iterator[tuple[int, bytes]]:
    a, b = span
    n = 0
    try:
        with open(path, "rb", buffering=_READ) as f:
            if a > 0:
                f.seek(a - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line under way at `a` started in an earlier span: it is that span's
            pos = f.tell()
            while pos < b:
                line = f.readline()
                if not line:
                    break
                pos += len(line)
                n += 1
                if n == 1 and a == 0 and line.startswith(_BOM):
                    line = line[len(_BOM):]
                yield n, line[:-1] if line.endswith(b"\n") else line
    except OSError as err:
        raise FileError("unreadable_file", f"{path}: {err}") from err
    if tally is not None:
        tally["lines"] = n


TO_END = 1 << 62
"""The end of a file's last byte range: whatever the file holds from its start on."""


def byte_spans(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
    """An uncompressed file cut into consecutive byte ranges of `unit_bytes`, the last one to the end; none when
    the file fits in one."""
    starts = range(0, path.stat().st_size, unit_bytes)
    return [(a, starts[i + 1] if i + 1 < len(starts) else TO_END) for i, a in enumerate(starts)] if len(starts) > 1 \
        else []


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


def _file_error(path: Path, err: FileError, records: int) -> Record:
    return Record(None, str(path), err.reason, f"{err}; {records} records read before it")


def read_jsonl(path: Path, field: str, span: tuple[int, int] | None = None,
               tally: dict[str, int] | None = None) -> Iterator[Record]:
    """One record per line of a (compressed) JSON-lines file, or of the lines starting in a byte `span` of an
    uncompressed one (`where` then numbers lines from the span's first; `tally["lines"]`: its lines, see
    read_lines); blank lines are skipped."""
    read = 0
    try:
        for n, line in read_lines(path, span, tally):
            where = f"{path}:{n}"
            if not line.strip():
                continue
            read += 1
            line = line.removeprefix(_BOM)  # files joined with `cat` carry each one's BOM into the middle
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                yield Record(None, where, "invalid_utf8", line[:2000].decode("utf-8", "replace"))
                continue
            try:
                obj = json.loads(text)
            except RecursionError:
                yield Record(None, where, "json_too_deep", text[:2000])
                continue
            except ValueError:  # JSONDecodeError, and integers past sys.get_int_max_str_digits()
                yield Record(None, where, "bad_json", text[:2000])
                continue
            yield _field_text(obj, field, where, text[:2000])
    except FileError as err:
        yield _file_error(path, err, read)


def parquet_columns(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return list(pq.ParquetFile(path).schema_arrow.names)


def parquet_spans(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
    """A parquet file's row groups cut into consecutive ranges [a, b) of about `unit_bytes` (uncompressed, from
    the footer); none when the footer cannot be read."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:  # unreadable: read whole, and counted malformed by the reader
        return []
    spans, a, size = [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= unit_bytes:
            spans.append((a, g + 1))
            a, size = g + 1, 0
    if a < meta.num_row_groups or not spans:
        spans.append((a, max(a + 1, meta.num_row_groups)))
    return spans


def read_parquet(path: Path, field: str, batch_rows: int = 1024,
                 row_groups: tuple[int, int] | None = None) -> Iterator[Record]:
    """One record per row of a parquet file (or of its row groups [a, b)), read batch by batch (only the text
    column); `where` is the file's row index, from 0 as pyarrow and pandas count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = row = 0
    try:
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise DataError(f"{path} has no column {field!r} (columns: {pf.schema_arrow.names}); set the source's "
                            f"text_field to the column holding the text")
        groups = None
        if row_groups is not None:
            groups = list(range(row_groups[0], min(row_groups[1], pf.metadata.num_row_groups)))
            first = row = sum(pf.metadata.row_group(g).num_rows for g in range(row_groups[0]))
            if not groups:
                return
        for batch in pf.iter_batches(batch_size=batch_rows, columns=[field], row_groups=groups):
            for value in batch.column(0).to_pylist():
                yield _field_text({field: value}, field, f"{path}:{row}", repr(value)[:2000])
                row += 1
    except (pa.ArrowException, OSError) as err:
        yield Record(None, str(path), "corrupt_file" if row > first else "unreadable_file",
                     f"{path}: {err}; {row - first} rows read before it")


def _hf_split(path: Path, split: str) -> Any:
    """One split of a saved dataset; of a DatasetDict only that split's directory is opened (not the others)."""
    import datasets

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        if split not in splits:
            raise ConfigError(f"{path} is a DatasetDict with splits {sorted(splits)}; the source's split={split!r} "
                              f"is not one of them — set split to the one to train on")
        path = path / split
    try:
        return datasets.load_from_disk(str(path))
    except (FileNotFoundError, NotADirectoryError) as err:
        raise DataError(f"the saved dataset {path} cannot be opened ({err}); its directory is missing or incomplete "
                        f"— save it again with save_to_disk, or point the source at another split") from err


def hf_columns(path: Path, split: str) -> list[str]:
    return list(_hf_split(path, split).column_names)


def hf_spans(path: Path, split: str, unit_bytes: int) -> list[tuple[int, int]]:
    """A saved dataset's rows cut into consecutive ranges [a, b) of about `unit_bytes` (of its memory-mapped
    arrow data)."""
    ds = _hf_split(path, split)
    n, size = len(ds), max(1, int(ds.data.nbytes))
    per = max(1, n * unit_bytes // size)
    return [(a, min(n, a + per)) for a in range(0, max(n, 1), per)]


def read_hf(path: Path, field: str, split: str = "train", rows: tuple[int, int] | None = None) -> Iterator[Record]:
    """Records of one split of a Hugging Face dataset saved with `save_to_disk` (a plain Dataset: all of it), or
    of its rows [a, b); `where` is the row index, from 0 as `dataset[i]` reads it."""
    ds = _hf_split(path, split)
    if field not in ds.column_names:
        raise DataError(f"{path} has no column {field!r} (columns: {ds.column_names}); set text_field")
    first = 0
    if rows is not None:
        first = rows[0]
        ds = ds.select(range(first, min(rows[1], len(ds))))
    for i, batch in enumerate(ds.select_columns([field]).iter(batch_size=256)):
        for j, v in enumerate(batch[field]):
            yield _field_text({field: v}, field, f"{path}:{first + 256 * i + j}", repr(v)[:2000])


def read_hf_files(path: Path, field: str, builder: str, split: str = "train") -> Iterator[Record]:
    """Local data files read through `datasets.load_dataset(builder, data_files=..., streaming=True)`."""
    import datasets

    ds = datasets.load_dataset(builder, data_files=str(path), split=split, streaming=True)
    for i, row in enumerate(ds):
        yield _field_text(row, field, f"{path}:{i}", repr(row)[:2000])


def _strip_compressed(name: str) -> str:
    low = name.lower()
    return next((name[:-len(c)] for c in COMPRESSED if low.endswith(c)), name)


def list_text_files(root: Path, glob: str) -> list[Path]:
    """Files of a text tree matching `glob` (a compressed file matches by its name without .gz/.zst/...), sorted
    (deterministic document order); files and folders whose name starts with a dot are skipped."""
    if root.is_file():
        return [root]
    return [p for p in _visible_files(root) if p.match(glob) or p.with_name(_strip_compressed(p.name)).match(glob)]


def read_text_tree(root: Path, glob: str = "*", encoding_fallback: str | None = None) -> Iterator[Record]:
    """One document per file under `root` matching `glob` (decompressed; a UTF-8 BOM dropped). A file that is
    not UTF-8 is malformed (`invalid_utf8`) unless `encoding_fallback` names a codec to decode it with."""
    for path in list_text_files(root, glob):
        try:
            data = b"".join(read_chunks(path))
        except FileError as err:
            yield _file_error(path, err, 0)
            continue
        if data.startswith(_BOM):
            data = data[len(_BOM):]
        try:
            yield Record(data.decode("utf-8"), str(path))
        except UnicodeDecodeError:
            if encoding_fallback is None:
                yield Record(None, str(path), "invalid_utf8", data[:2000].decode("utf-8", "replace"))
            else:
                yield Record(data.decode(encoding_fallback, "replace"), str(path),
                             note=f"encoding_fallback.{encoding_fallback}")


def input_files(path: Path, fmt: Format) -> list[Path]:
    """The files a jsonl/parquet source reads: the path itself, or its matching files when it is a directory."""
    if not path.is_dir():
        return [path]
    return [p for p in _visible_files(path) if _kind(p.name) == fmt]


def resolve_format(path: str | Path, fmt: Format = "auto") -> Format:
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise ConfigError(f"source path {str(p)!r} does not exist; fix the source's path")
    return detect_format(p) if fmt == "auto" else fmt


def read_records(path: str | Path, fmt: Format = "auto", field: str = "text", glob: str = "*",
                 hf_builder: str | None = None, split: str = "train",
                 encoding_fallback: str | None = None) -> Iterator[Record]:
    """Stream every record of a source.

    Args:
        path: A file or directory.
        fmt: jsonl / parquet / hf / text, or auto (from what is there: see `detect_format`).
        field: The text field (jsonl key, parquet or dataset column).
        glob: Text trees: which files are documents.
        hf_builder: Read `path` through `datasets.load_dataset(hf_builder, data_files=path)` instead
            (e.g. "json", "parquet", "text").
        split: Hugging Face datasets: which split (a saved DatasetDict holds several; default train).
        encoding_fallback: Text trees: the codec for files that are not UTF-8 (None: they are malformed).
    """
    p = Path(os.path.expanduser(str(path)))
    fmt = resolve_format(p, fmt)
    if hf_builder is not None:
        yield from read_hf_files(p, field, hf_builder, split)
        return
    if fmt == "text":
        yield from read_text_tree(p, glob, encoding_fallback)
    elif fmt == "hf":
        yield from read_hf(p, field, split)
    else:
        for f in input_files(p, fmt):
            yield from (read_parquet(f, field) if fmt == "parquet" else read_jsonl(f, field))
