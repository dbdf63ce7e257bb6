"""The ingest stage: read each source's ingest units, normalize and filter their documents, write them as shards;
resumable (a unit of work is skipped when its output exists).

Layout under `<output_dir>/work/`:
    ingest/<source>/shard-U-K.jsonl, .hash.npy      normalized, filtered documents ("t") of ingest unit U with
                                                    where each came from ("w": file:line or file), their hashes
                                                    (.hash.npy), the hashes sorted with their rows (.hsort.npy)
                                                    and each line's byte offset (.offsets.npy)
    ingest/<source>/unit-U.counts.json              the unit's accounting; written last = unit done
    ingest/<source>/unit-U.rejects.jsonl            malformed records with their reason
    ingest/<source>/unit-U.filtered.jsonl           the first documents each filter rule removed (samples)
    ingest/<source>/removed_sample-unit-U.jsonl     a sample of the removed text per rule, for its tokens
    ingest/<source>/unit-U.scores.jsonl, scores.jsonl   the quality classifier's score per document, and with
                                                    top_fraction the units' candidates (quality_scores.py)
    ingest/<source>/counts.json, filtered.jsonl,    the source's sums over its units (and its units' rejects in
        rejects.jsonl                               order); counts.json written last = source done
The shard files' readers and writer: data_pipeline/build/shard_files.py; the stages after this one: the dedup
stages (data_pipeline/build/shards.py names them), tokenize_stage.py, merge.py.
Every file is written under a temporary name and renamed, so a killed build leaves no half-written output.
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from data_pipeline.build.cache import write_json_atomic
from data_pipeline.build.config import BuildConfig, SourceConfig
from data_pipeline.build.filters import apply_filters, binary_reason, resolve_filters
from data_pipeline.build.ingest import (
    COMPRESSED,
    Record,
    byte_spans,
    hf_spans,
    input_files,
    list_text_files,
    parquet_spans,
    read_hf,
    read_jsonl,
    read_parquet,
    read_records,
    read_text_tree,
    resolve_format,
)
from data_pipeline.build.normalize import NormalizeConfig, normalize
from data_pipeline.build.progress import Progress, log
from data_pipeline.build.quality_scores import UnitScores, finish_scores
from data_pipeline.build.removed_tokens import RemovedSample
from data_pipeline.build.shard_files import UNITS, _rebase, _ShardWriter
from data_pipeline.build.workers import pool_worker

_CHUNK = 256  # records per worker task
FILTERED_SAMPLES = 20
"""Documents kept per filter rule in ingest/<source>/filtered.jsonl, to see what a rule removes."""
FILTERED_TEXT = 4000
"""Characters of each such document's normalized text kept with it (`tessera data sample --filtered` shows them;
binary.* rules keep none)."""
REMOVED_SAMPLE = "removed_sample*.jsonl"
"""ingest/<source>/: seeded samples of the removed text per rule (data_pipeline/build/removed_tokens.py); one file per
ingest unit (removed_sample-unit-U.jsonl): they add up."""


_W: dict[str, Any] = {}  # per-worker state set by the pool initializer (fork start: inherited cheaply)


def _init_filter_worker(norm: NormalizeConfig, cfg: BuildConfig, names: tuple[str, ...]) -> None:
    pool_worker()
    _W["norm"], _W["cfg"], _W["names"] = norm, cfg, names


Result = tuple[str | None, str | None, int, dict[str, int], dict[str, str], float | None]
"""(kept text or None, reason or None, characters in, characters trimmed from a kept text by cause, removed text
by cause: a filtered document's normalized text, or the lines a line rule cut; the quality classifier's score,
None when the document did not reach it)."""


def _filter_chunk(texts: list[str]) -> list[Result]:
    cfg: BuildConfig = _W["cfg"]
    out: list[Result] = []
    for text in texts:
        try:
            binary = binary_reason(text, cfg.filters.binary)  # before normalization strips the control characters
            if binary is not None:
                out.append((None, binary, len(text), {}, {}, None))
                continue
            norm = normalize(text, _W["norm"])
            if not norm.strip():
                out.append((None, "empty", len(text), {}, {}, None))
                continue
            trimmed, removed, scores = {"normalize": len(text) - len(norm)}, dict[str, str](), dict[str, float]()
            kept, reason = apply_filters(norm, _W["names"], cfg.filters, trimmed, removed, scores)
        except Exception as err:  # one pathological document never stops the build: it is counted instead
            out.append((None, f"malformed:filter_error.{type(err).__name__}", len(text), {}, {}, None))
            continue
        if kept is None:
            removed = {str(reason): norm}
        out.append((kept, reason, len(text), {k: v for k, v in trimmed.items() if v}, removed, scores.get("quality")))
    return out


def _chunks(src: SourceConfig, records: Iterator[Record], counts: dict[str, Any], rejects: Any,
            wheres: deque[list[str]]) -> Iterator[list[str]]:
    """Chunks of document texts (their `where`s appended to `wheres`); malformed records are counted (and written
    to `rejects`) here."""
    chunk: list[str] = []
    where: list[str] = []
    for rec in records:
        counts["in"] += 1
        if rec.text is None:
            _malformed(counts, str(rec.reason), len(rec.raw or ""))
            if rec.reason in ("truncated_file", "corrupt_file", "unreadable_file"):
                log(f"ingest {src.name}: {rec.raw} — counted as malformed ({rec.reason})")
            if rejects is not None:
                rejects.write(json.dumps({"reason": rec.reason, "where": rec.where, "raw": rec.raw}) + "\n")
            continue
        if rec.note:
            counts["notes"][rec.note] += 1
        chunk.append(rec.text)
        where.append(rec.where)
        if len(chunk) == _CHUNK:
            wheres.append(where)
            yield chunk
            chunk, where = [], []
    if chunk:
        wheres.append(where)
        yield chunk


def _malformed(counts: dict[str, Any], reason: str, chars: int) -> None:
    counts["malformed"][reason] += 1
    counts["chars"]["malformed"][reason] += chars
    counts["chars"]["in"] += chars


def _ordered(pool: ProcessPoolExecutor, chunks: Iterator[list[str]], depth: int) -> Iterator[list[Any]]:
    """Filter results in input order with at most `depth` chunks in flight (streaming: the source is never
    read ahead more than that); a dead worker raises BrokenProcessPool instead of hanging."""
    pending: deque[Future[list[Any]]] = deque()
    for chunk in chunks:
        pending.append(pool.submit(_filter_chunk, chunk))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def new_counts() -> dict[str, Any]:
    return {"in": 0, "kept": 0, "filtered": Counter(), "malformed": Counter(), "notes": Counter(),
            "chars": {"in": 0, "after_filters": 0, "filtered": Counter(), "malformed": Counter(),
                      "trimmed": Counter()}}


@dataclass(frozen=True)
class Unit:
    """What one ingest unit reads: `files` (none: the whole source, for sources read through `hf_builder`), or
    a `span` of one file — a byte range of an uncompressed jsonl file (the lines starting in it), row groups
    [a, b) of a parquet file, rows [a, b) of a saved HF dataset (`files` is then its directory)."""

    files: tuple[Path, ...] = ()
    span: tuple[int, int] | None = None


def source_units(src: SourceConfig, shard_docs: int, unit_bytes: int) -> list[Unit]:
    """A source cut into units of ingest work, independent of the task count: `shard_docs` files of a text tree;
    per file of a jsonl source (a file or a directory of them), byte ranges of `unit_bytes` (a compressed file,
    which cannot be read from an offset: the whole file); per parquet file, runs of row groups of about
    `unit_bytes`; for a saved HF dataset, row ranges of about `unit_bytes` of its arrow data; the whole source
    when read through `hf_builder`."""
    path = Path(os.path.expanduser(src.path))
    fmt = resolve_format(path, src.format)
    if src.hf_builder is not None:
        return [Unit()]
    if fmt == "hf":
        return _span_units(path, hf_spans(path, src.split, unit_bytes))
    if fmt == "text":
        files = list_text_files(path, src.glob)
        return [Unit(tuple(files[i:i + shard_docs])) for i in range(0, len(files), shard_docs)]
    units = []
    for f in input_files(path, fmt):
        if fmt == "parquet":
            units += _span_units(f, parquet_spans(f, unit_bytes))
        else:
            units += _span_units(f, [] if f.name.lower().endswith(COMPRESSED) else byte_spans(f, unit_bytes))
    return units


def _span_units(path: Path, spans: list[tuple[int, int]]) -> list[Unit]:
    """One unit per span, or one for the whole file when it has fewer than two."""
    return [Unit((path,), span) for span in spans] if len(spans) > 1 else [Unit((path,))]


def _unit_records(src: SourceConfig, unit: Unit, tally: dict[str, int]) -> Iterator[Record]:
    if not unit.files:
        yield from read_records(src.path, src.format, src.text_field, src.glob, src.hf_builder, src.split,
                                src.encoding_fallback)
        return
    fmt = resolve_format(src.path, src.format)
    for f in unit.files:
        if fmt == "text":
            yield from read_text_tree(f, "*", src.encoding_fallback)
        elif fmt == "hf":
            yield from read_hf(f, src.text_field, src.split, unit.span)
        elif fmt == "parquet":
            yield from read_parquet(f, src.text_field, row_groups=unit.span)
        else:
            yield from read_jsonl(f, src.text_field, unit.span, tally)


def _line_bases(units: list[Unit], lines: list[int]) -> list[int]:
    """Per unit, the lines of its file before its span (0 but for the later byte ranges of a jsonl file): a
    range unit numbers its lines from its own first, and the file's line number is that plus its base."""
    bases, before = [], dict[Path, int]()
    for unit, n in zip(units, lines, strict=True):
        f = unit.files[0] if unit.files else Path()
        bases.append(before.get(f, 0))
        before[f] = before.get(f, 0) + n
    return bases


def unit_name(u: int) -> str:
    return f"unit-{u:05d}"


def ingest_stage(cfg: BuildConfig, work: Path, task: int = 0, tasks: int = 1) -> None:
    """Stage 1: every source's units, numbered across sources in config order; this task does unit g with
    g % tasks == task. A source's counts.json is written by whichever task finishes its last unit."""
    g = 0
    for src in cfg.sources:
        out = work / "ingest" / src.name
        units = source_units(src, cfg.shard_docs, cfg.unit_bytes)
        mine = [u for u in range(len(units)) if (g + u) % tasks == task]
        g += len(units)
        if (out / "counts.json").is_file():
            continue
        out.mkdir(parents=True, exist_ok=True)
        todo = [u for u in mine if not (out / f"{unit_name(u)}.counts.json").is_file()]
        if todo:
            _ingest_units(cfg, src, out, units, todo)
        if all((out / f"{unit_name(u)}.counts.json").is_file() for u in range(len(units))):
            _finish_source(out, units, cfg, src)


def _ingest_units(cfg: BuildConfig, src: SourceConfig, out: Path, units: list[Unit], todo: list[int]) -> None:
    names = resolve_filters(src.filters, src.profile)
    bar = Progress(f"ingest {src.name}", "doc")
    total = new_counts()
    with ProcessPoolExecutor(cfg.workers, mp_context=get_context("fork"), initializer=_init_filter_worker,
                             initargs=(cfg.source_normalize(src), cfg, names)) as pool:
        for u in todo:
            for old in [*out.glob(f"shard-{u:05d}-*"), *out.glob(f"{unit_name(u)}.*"),
                        *out.glob(f"removed_sample-{unit_name(u)}.jsonl")]:
                old.unlink()  # a partial earlier attempt at this unit: redo it from scratch
            counts = _ingest_unit(cfg, src, out, u, units[u], pool, bar, "quality" in names)
            _merge_counts(total, counts)
    chars = total["chars"]
    bar.close(f"{total['in']:,} records, {total['kept']:,} kept after filters, "
              f"{sum(total['malformed'].values()):,} malformed in {len(todo)} of {len(units)} units; characters "
              f"{chars['in']:,} -> {chars['after_filters']:,} "
              f"({100 * chars['after_filters'] / max(1, chars['in']):.1f}%)")


def _ingest_unit(cfg: BuildConfig, src: SourceConfig, out: Path, u: int, unit: Unit, pool: ProcessPoolExecutor,
                 bar: Progress, scored: bool) -> dict[str, Any]:
    counts = new_counts()
    chars = counts["chars"]
    writer = _ShardWriter(out, f"shard-{u:05d}", cfg.shard_docs)
    rejects = open(out / f"{unit_name(u)}.rejects.jsonl", "w", encoding="utf-8") if cfg.rejects else None
    samples = open(out / f"{unit_name(u)}.filtered.jsonl", "w", encoding="utf-8")
    wheres: deque[list[str]] = deque()
    removed_sample = RemovedSample(cfg.seed + u)  # what the filters removed, its tokens counted once a tokenizer exists
    tally: dict[str, int] = {}
    scores = UnitScores(out, u, cfg.filters.quality) if scored else None
    try:
        chunks = _chunks(src, _unit_records(src, unit, tally), counts, rejects, wheres)
        for results in _ordered(pool, chunks, depth=4 * cfg.workers):
            for (kept, reason, n_chars, trimmed, removed, q), where in zip(results, wheres.popleft(), strict=True):
                if reason is not None and reason.startswith("malformed:"):
                    _malformed(counts, reason.split(":", 1)[1], n_chars)
                    continue
                if scores is not None and q is not None:
                    scores.add(where, q, reason)
                chars["in"] += n_chars
                if kept is None:
                    counts["filtered"][reason] += 1
                    chars["filtered"][reason] += n_chars
                    if counts["filtered"][reason] <= FILTERED_SAMPLES:
                        samples.write(json.dumps({"reason": reason, "where": where, "chars": n_chars,
                                                  "text": removed.get(str(reason), "")[:FILTERED_TEXT]},
                                                 ensure_ascii=False) + "\n")
                else:
                    counts["kept"] += 1
                    chars["after_filters"] += len(kept)
                    chars["trimmed"].update(trimmed)
                    if scores is not None and scores.defer:
                        scores.candidate(kept, where)  # its shard is written once the source's cut is known
                    else:
                        writer.add(kept, where)
                for cause, text in removed.items():
                    removed_sample.add(cause, text)
            bar.update(len(results))
        writer.flush()
        removed_sample.save(out / f"removed_sample-{unit_name(u)}.jsonl")
    finally:
        samples.close()
        if scores is not None:
            scores.close()
        if rejects is not None:
            rejects.close()
    counts["shards"] = writer.k
    if unit.span is not None and "lines" in tally:
        counts["lines"] = tally["lines"]  # a byte range's lines: the later ranges' line numbers start after them
    write_json_atomic(out / f"{unit_name(u)}.counts.json", _plain(counts))
    return counts


def _plain(counts: dict[str, Any]) -> dict[str, Any]:
    out = dict(counts)
    out["chars"] = dict(counts["chars"])
    for part in (out, out["chars"]):
        for k, v in part.items():
            if isinstance(v, Counter | dict) and k != "chars":
                part[k] = dict(sorted(v.items()))
    return out


def _merge_counts(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key in ("in", "kept", "shards"):
        total[key] = total.get(key, 0) + part.get(key, 0)
    for key in ("filtered", "malformed", "notes"):
        total[key].update(part[key])
    tc, pc = total["chars"], part["chars"]
    for key in ("in", "after_filters"):
        tc[key] += pc[key]
    for key in ("filtered", "malformed", "trimmed"):
        tc[key].update(pc[key])


def _finish_source(out: Path, units: list[Unit], cfg: BuildConfig, src: SourceConfig) -> None:
    """A source's units.json (line bases), counts.json (the sum over its units), filtered.jsonl (the first
    samples per rule, in order) and rejects.jsonl, with every `where` the file's own line number; with the quality
    filter, its scores and top-fraction cut (quality_scores.finish_scores)."""
    total = new_counts()
    total["shards"] = 0
    unit_counts = [json.loads((out / f"{unit_name(u)}.counts.json").read_text()) for u in range(len(units))]
    bases = _line_bases(units, [c.get("lines", 0) for c in unit_counts])
    write_json_atomic(out / UNITS, {"line_base": bases})
    per_rule: Counter[str] = Counter()
    tmp = out / "filtered.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for u, counts in enumerate(unit_counts):
            _merge_counts(total, counts)
            for line in (out / f"{unit_name(u)}.filtered.jsonl").read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                per_rule[row["reason"]] += 1
                if per_rule[row["reason"]] <= FILTERED_SAMPLES:
                    f.write(json.dumps({**row, "where": _rebase(row["where"], bases[u])}, ensure_ascii=False) + "\n")
        if "quality" in resolve_filters(src.filters, src.profile):
            cut = finish_scores(out, bases, total, cfg.filters.quality, cfg.shard_docs, cfg.seed)
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in cut[:FILTERED_SAMPLES])
    tmp.replace(out / "filtered.jsonl")
    rejects = [out / f"{unit_name(u)}.rejects.jsonl" for u in range(len(units))]
    if any(p.is_file() for p in rejects):
        with open(out / "rejects.jsonl.tmp", "w", encoding="utf-8") as f:
            for u, p in enumerate(rejects):
                if p.is_file():
                    for line in p.read_text(encoding="utf-8").splitlines():
                        row = json.loads(line)
                        f.write(json.dumps({**row, "where": _rebase(row["where"], bases[u])}) + "\n")
        (out / "rejects.jsonl.tmp").replace(out / "rejects.jsonl")
    write_json_atomic(out / "counts.json", _plain(total))
    for p in out.glob("unit-*.candidates.jsonl"):
        p.unlink()  # in the shards now
