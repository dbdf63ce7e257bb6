"""The shardable stages of a build, each resumable: a unit of work is skipped when its output exists.

Layout under `<output_dir>/work/`:
    ingest/<source>/shard-K.jsonl, shard-K.hash.npy   normalized, filtered documents and their hashes
    ingest/<source>/counts.json                       per-source accounting; written last = source done
    ingest/<source>/rejects.jsonl                     malformed records with their reason
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
from tqdm import tqdm

from data_pipeline.build_config import BuildConfig, SourceConfig
from data_pipeline.cache import write_json_atomic
from data_pipeline.filters import apply_filters, resolve_filters
from data_pipeline.indexed import IndexedWriter, import_megatron_builder
from data_pipeline.ingest import read_records
from data_pipeline.minhash import signatures
from data_pipeline.normalize import doc_hash, normalize

_CHUNK = 256  # records per worker task


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}.npy")
    np.save(tmp, arr)
    tmp.replace(path)


def read_shard_texts(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["t"] for line in f]


def list_shards(work: Path, stage: str, source: str, suffix: str) -> list[Path]:
    return sorted((work / stage / source).glob(f"shard-*{suffix}"))


# ---- ingest: read, normalize, filter ----

_W: dict[str, Any] = {}  # per-worker state set by the pool initializer (fork start: inherited cheaply)


def _init_filter_worker(cfg: BuildConfig, names: tuple[str, ...]) -> None:
    _W["cfg"], _W["names"] = cfg, names


def _filter_chunk(texts: list[str]) -> list[tuple[str | None, str | None, int]]:
    cfg: BuildConfig = _W["cfg"]
    out: list[tuple[str | None, str | None, int]] = []
    for text in texts:
        norm = normalize(text, cfg.normalize)
        if not norm.strip():
            out.append((None, "empty", len(text)))
            continue
        kept, reason = apply_filters(norm, _W["names"], cfg.filters)
        out.append((kept, reason, len(text)))
    return out


def _chunks(cfg: BuildConfig, src: SourceConfig, counts: dict[str, Any], rejects: Any) -> Iterator[list[str]]:
    """Chunks of document texts; malformed records are counted (and written to `rejects`) here."""
    chunk: list[str] = []
    for rec in read_records(src.path, src.format, src.text_field, src.glob, src.hf_builder):
        counts["in"] += 1
        if rec.text is None:
            counts["malformed"][rec.reason] += 1
            if rejects is not None:
                rejects.write(json.dumps({"reason": rec.reason, "where": rec.where, "raw": rec.raw}) + "\n")
            continue
        chunk.append(rec.text)
        if len(chunk) == _CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


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
        self.texts: list[str] = []

    def add(self, text: str) -> None:
        self.texts.append(text)
        if len(self.texts) == self.shard_docs:
            self.flush()

    def flush(self) -> None:
        if not self.texts:
            return
        name = shard_name(self.k)
        tmp = self.out / f"{name}.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for t in self.texts:
                f.write(json.dumps({"t": t}, ensure_ascii=False) + "\n")
        save_npy_atomic(self.out / f"{name}.hash.npy", np.array([doc_hash(t) for t in self.texts], dtype=np.uint64))
        tmp.replace(self.out / f"{name}.jsonl")
        self.k, self.texts = self.k + 1, []


def ingest_source(cfg: BuildConfig, src: SourceConfig, work: Path) -> dict[str, Any]:
    """Stage 1 for one source; returns its counts (and skips the work when they were already written)."""
    out = work / "ingest" / src.name
    done = out / "counts.json"
    if done.is_file():
        counts: dict[str, Any] = json.loads(done.read_text())
        return counts
    shutil.rmtree(out, ignore_errors=True)  # a partial earlier attempt: redo this source from scratch
    out.mkdir(parents=True)
    counts = {"in": 0, "kept": 0, "filtered": Counter(), "malformed": Counter(), "chars_in": 0, "chars_kept": 0}
    names = resolve_filters(src.filters, src.profile)
    writer = _ShardWriter(out, cfg.shard_docs)
    rejects = open(out / "rejects.jsonl", "w", encoding="utf-8") if cfg.rejects else None
    try:
        with ProcessPoolExecutor(cfg.workers, mp_context=get_context("fork"), initializer=_init_filter_worker,
                                 initargs=(cfg, names)) as pool, \
                tqdm(desc=f"ingest {src.name}", unit="doc", disable=None) as bar:
            for results in _ordered(pool, _chunks(cfg, src, counts, rejects), depth=4 * cfg.workers):
                for kept, reason, chars in results:
                    counts["chars_in"] += chars
                    if kept is None:
                        counts["filtered"][reason] += 1
                    else:
                        counts["kept"] += 1
                        counts["chars_kept"] += len(kept)
                        writer.add(kept)
                bar.update(len(results))
        writer.flush()
    finally:
        if rejects is not None:
            rejects.close()
    counts["filtered"], counts["malformed"] = dict(counts["filtered"]), dict(counts["malformed"])
    counts["shards"] = writer.k
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
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("fork")) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
        for fut in tqdm(as_completed(futures), total=len(jobs), desc=desc, unit="shard", disable=None):
            fut.result()


# ---- tokenize kept documents, one shard per task ----

def _tokenize_task(args: tuple[Path, Path, str, np.ndarray]) -> None:
    from data_pipeline.tokenizer import Tokenizer

    shard, out_prefix, model, status = args  # status per doc: 0 kept, 1 exact duplicate, 2 near duplicate
    tok = Tokenizer(model)
    writer = IndexedWriter(out_prefix, tok.vocab_size)
    tokens = np.zeros(3, dtype=np.int64)
    texts = read_shard_texts(shard)
    for start in range(0, len(texts), 512):
        for st, ids in zip(status[start:start + 512], tok.encode_docs(texts[start:start + 512]), strict=True):
            tokens[st] += len(ids)
            if st == 0:
                writer.add(ids)
    writer.finalize()
    write_json_atomic(Path(str(out_prefix) + ".stats.json"), {
        "kept": int(tokens[0]), "exact_duplicate": int(tokens[1]), "near_duplicate": int(tokens[2])})


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
