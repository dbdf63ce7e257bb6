"""Build the embedded stdlib corpus: extract three domains to jsonl, then run the full build pipeline on them.

Used by `prepare_data` for data.kind=stdlib (the smoke job and the tests). About 20-30 s on 2 busy cores for
the whole standard library (~31 MB of Python, ~12 M tokens at vocab 4096).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.dedup import DedupConfig
from data_pipeline.build.run import run_build
from data_pipeline.build.stdlib_corpus import DOMAINS, iter_stdlib_documents, stdlib_identity
from data_pipeline.config import DataConfig

STDLIB_BUILD_VERSION = 5  # 4: the code profile drops "generated from X with Y" files (gencodec codecs), encoded data;
# 5: the tokenizer trains at character_coverage 1.0 (the corpus is alphabetic: data_pipeline/script_stats.py)


def stdlib_build_key(cfg: DataConfig) -> dict[str, Any]:
    """Everything the stdlib build's output depends on (mixing settings are applied at train time)."""
    return {"version": STDLIB_BUILD_VERSION, "vocab_size": cfg.vocab_size, "tokenizer_type": cfg.tokenizer_type,
            "tokenizer_sample_chars": cfg.tokenizer_sample_chars, "dedup": asdict(DedupConfig()), **stdlib_identity()}


def stdlib_build_config(out: Path, cfg: DataConfig) -> BuildConfig:
    """The build of the stdlib corpus: code and tests through the code profile, prose through length only."""
    sources = [SourceConfig(name="code", path=str(out / "raw" / "code.jsonl"), profile="code", priority=2),
               SourceConfig(name="tests", path=str(out / "raw" / "tests.jsonl"), profile="code", priority=1),
               SourceConfig(name="prose", path=str(out / "raw" / "prose.jsonl"), profile="minimal")]
    return BuildConfig(output_dir=str(out), sources=sources, workers=max(1, min(2, os.cpu_count() or 1)),
                       tokenizer=TokenizerConfig(vocab_size=cfg.vocab_size, type=cfg.tokenizer_type,
                                                 sample_chars=cfg.tokenizer_sample_chars), seed=cfg.seed)


def write_stdlib_sources(raw: Path, workers: int) -> dict[str, int]:
    """The standard library as one jsonl file per domain under `raw`; returns documents per domain."""
    raw.mkdir(parents=True, exist_ok=True)
    files = {d: open(raw / f"{d}.jsonl", "w", encoding="utf-8") for d in DOMAINS}
    counts = dict.fromkeys(DOMAINS, 0)
    try:
        for domain, text in tqdm(iter_stdlib_documents(workers), desc="stdlib: extract", unit="doc", disable=None):
            files[domain].write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            counts[domain] += 1
    finally:
        for f in files.values():
            f.close()
    return counts


def build_stdlib(out: Path, cfg: DataConfig) -> None:
    """Write the stdlib corpus build (tokenizer, .bin/.idx + hashes per domain, manifest) into `out`.

    The corpus goes through the same pipeline as any `tessera data build` (filters, exact and near dedup,
    accounting); only the raw jsonl and the stage files are deleted afterwards to keep the cache small.
    """
    build = stdlib_build_config(out, cfg)
    write_stdlib_sources(out / "raw", build.workers)
    run_build(build)
    shutil.rmtree(out / "raw")
    shutil.rmtree(out / "work")
