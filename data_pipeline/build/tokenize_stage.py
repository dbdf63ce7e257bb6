"""The tokenize stage: the kept documents of each ingest shard into `tokens/<source>/shard-U-K.{bin,idx}` and
`.stats.json` (tokens and characters of kept, exact- and near-duplicate documents), one shard per task.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.cache import write_json_atomic
from data_pipeline.build.config import BuildConfig
from data_pipeline.build.shard_files import read_shard_texts
from data_pipeline.build.workers import run_pool
from data_pipeline.indexed import IndexedWriter

_TOKENIZERS: dict[tuple[str, int], Any] = {}


def load_tokenizer(model: str) -> Any:
    """The Tokenizer of `model`, loaded once per process (keyed by path and modification time): a worker reuses
    it across shards, and one loaded before the pool forks is inherited (a 100k-vocabulary tokenizer.json takes
    ~0.5 s to load, as long as tokenizing a few MB)."""
    from data_pipeline.tokenizer import Tokenizer

    key = (model, os.stat(model).st_mtime_ns)
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = Tokenizer(model)
    return _TOKENIZERS[key]


def _tokenize_task(args: tuple[Path, Path, str, np.ndarray]) -> None:
    shard, out_prefix, model, status = args  # status per doc: 0 kept, 1 exact duplicate, 2 near duplicate
    tok = load_tokenizer(model)
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


def tokenize_shards(cfg: BuildConfig, model: Path, shards: Sequence[tuple[Path, Path]],
                    status_of: Callable[[int], np.ndarray], task: int = 0, tasks: int = 1) -> None:
    """Tokens of each shard's kept documents, with EOS after each, into a partial .bin/.idx (this task's shards:
    index k with k % tasks == task). `shards` are (ingest jsonl, tokens prefix); `status_of(k)` the documents'
    outcomes of shard k (0 kept, 1 exact, 2 near duplicate)."""
    jobs = []
    for k, (jsonl, prefix) in enumerate(shards):
        if k % tasks == task and not Path(str(prefix) + ".stats.json").is_file():
            prefix.parent.mkdir(parents=True, exist_ok=True)
            jobs.append((jsonl, prefix, str(model), status_of(k)))
    if jobs:
        load_tokenizer(str(model))  # once in the parent: forked workers inherit it instead of loading it each
    run_pool(_tokenize_task, jobs, cfg.workers, "tokenize", "shard")
