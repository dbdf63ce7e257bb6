"""Tokenize-stage throughput, tokens per CPU-second (= per core), for each tokenizer type a build accepts.

The timed code is the build's own tokenize task (`data_pipeline.build.tokenize_stage._tokenize_task`: load the
tokenizer, encode a shard in batches of 512 with EOS appended, write the partial .bin/.idx and its stats) on one
shard of real text: the standard library's .py files (code) and the machine's licence/README/METADATA files (prose).
Tokenizers, all trained here on a sample of the same text (no download):
  sentencepiece : `tokenizer.type=sentencepiece` (BPE, byte fallback), a `.model`;
  hf_bpe        : `tokenizer.type=hf_bpe`, GPT-2-style byte-level BPE trained with HF tokenizers — also what a
                  given byte-level `tokenizer.json` runs through (the same encoder);
  tiktoken      : a tiktoken ranks file (the hf_bpe vocabulary as ranks) as a build takes it (`_given_tokenizer`):
                  converted to tokenizer.json with the cl100k pattern, the ranks kept beside it, encoded natively
                  by tiktoken;
  tiktoken_hf   : the same converted tokenizer.json without the ranks beside it: encoded by HF tokenizers (what
                  the stage did before it encoded natively; the same ids).
The tokenizer is loaded before the clock starts (a worker loads it once, not per shard; load time printed).
Reference in the same run: the library's own batch encode of the same texts on one thread (sentencepiece
`encode(list)`, tokenizers `encode_batch`, tiktoken `encode_ordinary_batch` on the original ranks): the ratio
is the stage's overhead (EOS, int64 arrays, the writer, stats). CPU time from getrusage, threads included.

    PYTHONPATH=. RAYON_NUM_THREADS=1 nice -n 19 python bench/tokenize_throughput.py --mb 4 --vocab 32000
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import resource
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py`: bench.* from the root


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def corpus(kind: str, mb: float) -> list[str]:
    from bench.dedup_eval import iter_natural
    from data_pipeline.build.stdlib_corpus import list_stdlib_files

    out, size = [], 0
    if kind == "code":
        it = (p.read_text(encoding="utf-8", errors="replace") for _, p in list_stdlib_files())
    else:
        it = (d.text for d in iter_natural("prose", max_words=1 << 30))
    for text in it:
        out.append(text)
        size += len(text.encode())
        if size >= mb * 1e6:
            break
    return out


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    c0 = cpu_seconds()
    n = fn()
    return cpu_seconds() - c0, n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of text per domain")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--dry", action="store_true", help="0.05 MB, vocab 600")
    args = parser.parse_args(argv)
    if args.dry:
        args.mb, args.vocab = 0.05, 600
    import tiktoken

    from data_pipeline.build.config import BuildConfig, TokenizerConfig
    from data_pipeline.build.run import _given_tokenizer
    from data_pipeline.build.tokenize_stage import _tokenize_task, load_tokenizer
    from data_pipeline.tokenizer import (
        CL100K_PATTERN,
        Tokenizer,
        _bytes_to_unicode,
        sample_lines,
        tiktoken_to_hf,
        train_hf_bpe,
        train_sentencepiece,
    )

    texts = {k: corpus(k, args.mb) for k in ("code", "prose")}
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lines = sample_lines([t for ts in texts.values() for t in ts], max_chars=int(min(args.mb, 2) * 2e6))
        models = {"sentencepiece": train_sentencepiece(lines, root / "sp.model", vocab_size=args.vocab, threads=1),
                  "hf_bpe": train_hf_bpe(lines, root / "bpe" / "tokenizer.json", vocab_size=args.vocab)}
        spec = json.loads(models["hf_bpe"].read_text())
        u2b = {c: b for b, c in _bytes_to_unicode().items()}
        special = {t["content"] for t in spec["added_tokens"]}
        vocab = sorted(((bytes(u2b[c] for c in t), i) for t, i in spec["model"]["vocab"].items() if t not in special),
                       key=lambda kv: kv[1])
        ranks = {tok: r for r, (tok, _) in enumerate(vocab)}
        tik = root / "ranks.tiktoken"
        tik.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
        models["tiktoken"] = _given_tokenizer(BuildConfig(output_dir=str(root), sources=[], tokenizer=TokenizerConfig(
            model=str(tik))), root / "tik")
        models["tiktoken_hf"] = tiktoken_to_hf(tik, root / "tik_hf")
        enc = tiktoken.Encoding("bench", pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})
        for kind, docs in texts.items():
            shard = root / f"{kind}.jsonl"
            shard.write_text("".join(json.dumps({"t": t}) + "\n" for t in docs))
            mbytes = sum(len(t.encode()) for t in docs) / 1e6
            for name, model in models.items():
                tok = Tokenizer(model)
                load_s, _ = timed(lambda model=model: len(load_tokenizer(str(model)).path))
                assert (tok._tiktoken is not None) == (name == "tiktoken")

                def stage(name: str = name, model: Path = model, kind: str = kind, shard: Path = shard,
                          docs: list[str] = docs) -> int:
                    prefix = root / f"out-{kind}-{name}"
                    _tokenize_task((shard, prefix, str(model), np.zeros(len(docs), dtype=np.int8)))
                    return int(json.loads(Path(str(prefix) + ".stats.json").read_text())["kept"])

                if name == "sentencepiece":
                    def library(tok: Tokenizer = tok, docs: list[str] = docs) -> int:
                        return sum(len(x) for x in tok._sp.encode(docs, num_threads=1))
                elif name.startswith("tiktoken"):
                    def library(tok: Tokenizer = tok, docs: list[str] = docs) -> int:
                        return sum(len(x) for x in enc.encode_ordinary_batch(docs, num_threads=1))
                else:
                    def library(tok: Tokenizer = tok, docs: list[str] = docs) -> int:
                        return sum(len(e.ids) for e in tok._hf.encode_batch(docs, add_special_tokens=False))
                (cpu, n), (lib_cpu, lib_n) = timed(stage), timed(library)
                rows[f"{kind}/{name}"] = {"MB": round(mbytes, 2), "tokens": n, "stage_tokens_per_cpu_s": n / cpu,
                                          "library_tokens_per_cpu_s": lib_n / lib_cpu, "stage_cpu_s": cpu,
                                          "bytes_per_token": mbytes * 1e6 / n, "load_cpu_s": load_s}
                print(f"{kind:5s} {name:14s} {mbytes:5.1f} MB {n:9d} tokens ({mbytes * 1e6 / n:4.2f} B/token): stage "
                      f"{n / cpu:10.0f} tokens/CPU-s; library alone {lib_n / lib_cpu:10.0f}; stage / library "
                      f"{(n / cpu) / (lib_n / lib_cpu):.2f}; load {load_s:.2f} CPU-s", flush=True)
    print(f"vocab {args.vocab}; RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS')}; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
