"""Build the embedded stdlib corpus: extract -> normalize -> exact dedup -> sentencepiece -> .bin/.idx per domain.

Used by `prepare_data` for data.kind=stdlib (the smoke job and the tests). About 20-30 s on 2 busy cores for
the whole standard library (~31 MB of Python, ~12 M tokens at vocab 4096).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from tqdm import tqdm

from data_pipeline.cache import MANIFEST, write_json_atomic
from data_pipeline.config import DataConfig
from data_pipeline.indexed import IndexedWriter
from data_pipeline.stdlib_corpus import DOMAINS, iter_stdlib_documents, stdlib_identity
from data_pipeline.tokenizer import Tokenizer, iter_chunks, sample_lines, train_sentencepiece

STDLIB_BUILD_VERSION = 1


def stdlib_build_key(cfg: DataConfig) -> dict[str, Any]:
    """Everything the stdlib build's output depends on (mixing settings are applied at train time)."""
    return {"version": STDLIB_BUILD_VERSION, "vocab_size": cfg.vocab_size, "tokenizer_type": cfg.tokenizer_type,
            "tokenizer_sample_chars": cfg.tokenizer_sample_chars, **stdlib_identity()}


def doc_hash(text: str) -> int:
    """64-bit content hash of a normalized document (exact dedup and the held-out split)."""
    return int(xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass")))


def _collect(workers: int) -> tuple[dict[str, list[str]], dict[str, dict[str, int]]]:
    docs: dict[str, list[str]] = {d: [] for d in DOMAINS}
    counts = {d: {"in": 0, "kept": 0, "exact_duplicate": 0, "filtered_empty": 0} for d in DOMAINS}
    seen: set[int] = set()
    for domain, raw in tqdm(iter_stdlib_documents(workers), desc="stdlib: extract", unit="doc", disable=None):
        c = counts[domain]
        c["in"] += 1
        text = unicodedata.normalize("NFC", raw).strip()
        if not text:
            c["filtered_empty"] += 1
            continue
        h = doc_hash(text)
        if h in seen:  # license headers, repeated docstrings, vendored copies
            c["exact_duplicate"] += 1
            continue
        seen.add(h)
        docs[domain].append(text)
        c["kept"] += 1
    return docs, counts


def build_stdlib(out: Path, cfg: DataConfig) -> None:
    """Write the stdlib corpus build (tokenizer, .bin/.idx + hashes per domain, manifest) into `out`."""
    workers = max(1, min(2, os.cpu_count() or 1))
    docs, counts = _collect(workers)
    total_chars = sum(len(t) for ds in docs.values() for t in ds)
    keep = min(1.0, 1.5 * cfg.tokenizer_sample_chars / max(1, total_chars))
    # Round-robin over domains so every domain is in the tokenizer's sample, whatever the cut-off.
    interleaved = [t for group in itertools.zip_longest(*docs.values()) for t in group if t is not None]
    lines = sample_lines(interleaved, cfg.tokenizer_sample_chars, seed=cfg.seed, keep=keep)
    model = train_sentencepiece(lines, out / "tokenizer.model", vocab_size=cfg.vocab_size,
                                model_type=cfg.tokenizer_type, threads=workers)
    tok = Tokenizer(model)
    sources: dict[str, Any] = {}
    digest = hashlib.sha256()
    for domain in DOMAINS:
        writer = IndexedWriter(out / domain, tok.vocab_size)
        hashes = np.array([doc_hash(t) for t in docs[domain]], dtype=np.uint64)
        for chunk in tqdm(list(iter_chunks(docs[domain], 256)), desc=f"stdlib: tokenize {domain}", disable=None):
            for ids in tok.encode_docs(chunk, threads=workers):
                writer.add(ids)
        writer.finalize()
        np.save(out / f"{domain}.hash.npy", hashes)
        c = counts[domain]
        assert c["in"] == c["kept"] + c["exact_duplicate"] + c["filtered_empty"], c
        sources[domain] = {
            "documents": {"in": c["in"], "kept": c["kept"], "filtered": {"empty": c["filtered_empty"]},
                          "exact_duplicate": c["exact_duplicate"], "near_duplicate": 0, "malformed": {}},
            "tokens": {"kept": writer.num_tokens},
        }
        digest.update(f"{domain}:{writer.num_docs}:{writer.num_tokens}:".encode())
        digest.update(hashes.tobytes())
    info = tok.info()
    digest.update(info.sha256.encode())
    write_json_atomic(out / MANIFEST, {
        "version": STDLIB_BUILD_VERSION, "kind": "stdlib", "config": stdlib_build_key(cfg), "sources": sources,
        "tokenizer": {**info.__dict__, "path": "tokenizer.model"}, "fingerprint": digest.hexdigest()})
