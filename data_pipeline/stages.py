"""The shardable stages of a build, each resumable: a unit of work is skipped when its output exists.

Layout under `<output_dir>/work/`:
    ingest/<source>/shard-K.jsonl, shard-K.hash.npy   normalized, filtered documents ("t") with where each came
                                                      from ("w": file:line or file), and their hashes
    ingest/<source>/counts.json                       per-source accounting; written last = source done
    ingest/<source>/rejects.jsonl                     malformed records with their reason
    ingest/<source>/filtered.jsonl                    the first documents each filter rule removed (samples)
    ingest/<source>/removed_sample.jsonl              a sample of the removed text per rule, for its tokens
    minhash/<source>/shard-K.sig.npy                  MinHash signatures (uint32, docs x bands*rows)
    tokens/<source>/shard-K.{bin,idx}, .stats.json    tokens of kept documents (megatron-core's builder)
Every file is written under a temporary name and renamed, so a killed build leaves no half-written output.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build_config import BuildConfig, SourceConfig
from data_pipeline.cache import write_json_atomic
from data_pipeline.filters import apply_filters, resolve_filters
from data_pipeline.indexed import IndexedWriter, import_megatron_builder
from data_pipeline.ingest import read_records
from data_pipeline.minhash import signatures
from data_pipeline.normalize import NormalizeConfig, doc_hash, normalize
from data_pipeline.progress import Progress, log
from data_pipeline.removed_tokens import RemovedSample

_CHUNK = 256  # records per worker task
FILTERED_SAMPLES = 20
"""Documents kept per filter rule in ingest/<source>/filtered.jsonl, to see what a rule removes."""
REMOVED_SAMPLE = "removed_sample*.jsonl"
"""ingest/<source>/: seeded samples of the removed text per rule (data_pipeline/removed_tokens.py); one file per
ingest unit (removed_sample.jsonl, or removed_sample-<task>.jsonl where a source's ingest is split): they add up."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}.npy")
    np.save(tmp, arr)
    tmp.replace(path)


def read_shard_texts(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["t"] for line in f]


def read_shard_where(path: Path) -> list[str]:
    """Where each document of an ingest shard came from (file:line, or the file of a text tree)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line).get("w", "?") for line in f]


def list_shards(work: Path, stage: str, source: str, suffix: str) -> list[Path]:
    return sorted((work / stage / source).glob(f"shard-*{suffix}"))


# ---- ingest: read, normalize, filter ----

_W: dict[str, Any] = {}  # per-worker state set by the pool initializer (fork start: inherited cheaply)


def _init_filter_worker(norm: NormalizeConfig, cfg: BuildConfig, names: tuple[str, ...]) -> None:
    _W["norm"], _W["cfg"], _W["names"] = norm, cfg, names


Result = tuple[str | None, str | None, int, dict[str, int], dict[str, str]]
"""(kept text or None, reason or None, characters in, characters trimmed from a kept text by cause, removed text
by cause: a filtered document's normalized text, or the lines a line rule cut)."""


def _filter_chunk(texts: list[str]) -> list[Result]:
    cfg: BuildConfig = _W["cfg"]
    out: list[Result] = []
    for text in texts:
        try:
            norm = normalize(text, _W["norm"])
            if not norm.strip():
                out.append((None, "empty", len(text), {}, {}))
                continue
            trimmed, removed = {"normalize": len(text) - len(norm)}, dict[str, str]()
            kept, reason = apply_filters(norm, _W["names"], cfg.filters, trimmed, removed)
        except Exception as err:  # one pathological document never stops the build: it is counted instead
            out.append((None, f"malformed:filter_error.{type(err).__name__}", len(text), {}, {}))
            continue
        if kept is None:
            removed = {str(reason): norm}
        out.append((kept, reason, len(text), {k: v for k, v in trimmed.items() if v}, removed))
    return out


def _chunks(src: SourceConfig, counts: dict[str, Any], rejects: Any, wheres: deque[list[str]]
            ) -> Iterator[list[str]]:
    """Chunks of document texts (their `where`s appended to `wheres`); malformed records are counted (and written
    to `rejects`) here."""
    chunk: list[str] = []
    where: list[str] = []
    for rec in read_records(src.path, src.format, src.text_field, src.glob, src.hf_builder, src.split,
                            src.encoding_fallback):
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


class _ShardWriter:
    def __init__(self, out: Path, shard_docs: int) -> None:
        self.out, self.shard_docs, self.k = out, shard_docs, 0
        self.texts: list[tuple[str, str]] = []

    def add(self, text: str, where: str) -> None:
        self.texts.append((text, where))
        if len(self.texts) == self.shard_docs:
            self.flush()

    def flush(self) -> None:
        if not self.texts:
            return
        name = shard_name(self.k)
        tmp = self.out / f"{name}.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for t, w in self.texts:
                f.write(json.dumps({"t": t, "w": w}, ensure_ascii=False) + "\n")
        save_npy_atomic(self.out / f"{name}.hash.npy",
                        np.array([doc_hash(t) for t, _ in self.texts], dtype=np.uint64))
        tmp.replace(self.out / f"{name}.jsonl")
        self.k, self.texts = self.k + 1, []


def new_counts() -> dict[str, Any]:
    return {"in": 0, "kept": 0, "filtered": Counter(), "malformed": Counter(), "notes": Counter(),
            "chars": {"in": 0, "after_filters": 0, "filtered": Counter(), "malformed": Counter(),
                      "trimmed": Counter()}}


def ingest_source(cfg: BuildConfig, src: SourceConfig, work: Path) -> dict[str, Any]:
    """Stage 1 for one source; returns its counts (and skips the work when they were already written)."""
    out = work / "ingest" / src.name
    done = out / "counts.json"
    if done.is_file():
        counts: dict[str, Any] = json.loads(done.read_text())
        return counts
    shutil.rmtree(out, ignore_errors=True)  # a partial earlier attempt: redo this source from scratch
    out.mkdir(parents=True)
    counts = new_counts()
    chars = counts["chars"]
    names = resolve_filters(src.filters, src.profile)
    writer = _ShardWriter(out, cfg.shard_docs)
    rejects = open(out / "rejects.jsonl", "w", encoding="utf-8") if cfg.rejects else None
    samples = open(out / "filtered.jsonl", "w", encoding="utf-8")
    wheres: deque[list[str]] = deque()
    removed_sample = RemovedSample(cfg.seed)  # tokens of what the filters removed, counted once a tokenizer exists
    bar = Progress(f"ingest {src.name}", "doc")
    try:
        with ProcessPoolExecutor(cfg.workers, mp_context=get_context("fork"), initializer=_init_filter_worker,
                                 initargs=(cfg.source_normalize(src), cfg, names)) as pool:
            chunks = _chunks(src, counts, rejects, wheres)
            for results in _ordered(pool, chunks, depth=4 * cfg.workers):
                for (kept, reason, n_chars, trimmed, removed), where in zip(results, wheres.popleft(), strict=True):
                    if reason is not None and reason.startswith("malformed:"):
                        _malformed(counts, reason.split(":", 1)[1], n_chars)
                        continue
                    chars["in"] += n_chars
                    if kept is None:
                        counts["filtered"][reason] += 1
                        chars["filtered"][reason] += n_chars
                        if counts["filtered"][reason] <= FILTERED_SAMPLES:
                            samples.write(json.dumps({"reason": reason, "where": where, "chars": n_chars},
                                                     ensure_ascii=False) + "\n")
                    else:
                        counts["kept"] += 1
                        chars["after_filters"] += len(kept)
                        chars["trimmed"].update(trimmed)
                        writer.add(kept, where)
                    for cause, text in removed.items():
                        removed_sample.add(cause, text)
                bar.update(len(results))
        writer.flush()
        removed_sample.save(out / "removed_sample.jsonl")
    finally:
        samples.close()
        if rejects is not None:
            rejects.close()
    for part in (counts, chars):
        for k, v in part.items():
            if isinstance(v, Counter):
                part[k] = dict(sorted(v.items()))
    counts["shards"] = writer.k
    bar.close(f"{counts['in']:,} records, {counts['kept']:,} kept after filters, "
              f"{sum(counts['malformed'].values()):,} malformed; characters {chars['in']:,} -> "
              f"{chars['after_filters']:,} ({100 * chars['after_filters'] / max(1, chars['in']):.1f}%)")
    write_json_atomic(done, counts)
    return counts


# ---- minhash signatures, one shard per task ----

def _signature_task(args: tuple[Path, Path, Any]) -> None:
    shard, out, mh = args
    save_npy_atomic(out, signatures(read_shard_texts(shard), mh))


def minhash_shards(cfg: BuildConfig, work: Path, task: int = 0, tasks: int = 1) -> None:
    """Signatures of every ingested shard (this task's share: shards with index % tasks == task)."""
    jobs = []
    for src in cfg.sources:
        for i, shard in enumerate(list_shards(work, "ingest", src.name, ".jsonl")):
            out = work / "minhash" / src.name / shard.name.replace(".jsonl", ".sig.npy")
            if i % tasks == task and not out.is_file():
                out.parent.mkdir(parents=True, exist_ok=True)
                jobs.append((shard, out, cfg.dedup.minhash))
    _run_pool(_signature_task, jobs, cfg.workers, "minhash")


def _run_pool(fn: Any, jobs: list[Any], workers: int, desc: str) -> None:
    """Run shard jobs in worker processes; a worker that dies (e.g. OOM-killed) fails the stage loudly
    (BrokenProcessPool) instead of hanging, and the rerun redoes only the unfinished shards."""
    if not jobs:
        return
    bar = Progress(desc, "shard", total=len(jobs))
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("fork")) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
        for fut in as_completed(futures):
            fut.result()
            bar.update()
    bar.close()


# ---- tokenize kept documents, one shard per task ----

def _tokenize_task(args: tuple[Path, Path, str, np.ndarray]) -> None:
    from data_pipeline.tokenizer import Tokenizer

    shard, out_prefix, model, status = args  # status per doc: 0 kept, 1 exact duplicate, 2 near duplicate
    tok = Tokenizer(model)
    writer = IndexedWriter(out_prefix, tok.vocab_size)
    tokens = np.zeros(3, dtype=np.int64)
    chars = np.zeros(3, dtype=np.int64)
    texts = read_shard_texts(shard)
    for start in range(0, len(texts), 512):
        batch = texts[start:start + 512]
        for st, ids, text in zip(status[start:start + 512], tok.encode_docs(batch), batch, strict=True):
            tokens[st] += len(ids)
            chars[st] += len(text)
            if st == 0:
                writer.add(ids)
    writer.finalize()
    names = ("kept", "exact_duplicate", "near_duplicate")
    write_json_atomic(Path(str(out_prefix) + ".stats.json"), {
        **{k: int(tokens[i]) for i, k in enumerate(names)}, "chars": {k: int(chars[i]) for i, k in enumerate(names)}})


def tokenize_shards(cfg: BuildConfig, work: Path, model: Path, status: dict[str, list[np.ndarray]],
                    task: int = 0, tasks: int = 1) -> None:
    """Tokens of each shard's kept documents, with EOS after each, into a partial .bin/.idx."""
    jobs = []
    for src in cfg.sources:
        for i, shard in enumerate(list_shards(work, "ingest", src.name, ".jsonl")):
            prefix = work / "tokens" / src.name / shard.name.replace(".jsonl", "")
            if i % tasks == task and not Path(str(prefix) + ".stats.json").is_file():
                prefix.parent.mkdir(parents=True, exist_ok=True)
                jobs.append((shard, prefix, str(model), status[src.name][i]))
    if jobs:
        import_megatron_builder()  # once in the parent: forked workers inherit it instead of paying ~4.5 s each
    _run_pool(_tokenize_task, jobs, cfg.workers, "tokenize")
