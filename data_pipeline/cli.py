"""CLI: `tessera data build CONFIG`, `tessera data stats BUILD`, `tessera data sample BUILD --source S`,
`tessera tokenizer train`.

Registered by framework/cli.py through `register(subparsers)`; argparse only here, heavy imports in handlers.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

STAGE_HELP = "ingest, exact, minhash, pairs, verify, near, tokenizer, tokenize, merge, manifest"


def _task_from_env(args: argparse.Namespace) -> tuple[int, int]:
    """--task/--tasks, defaulting to the SLURM job array's task id and count when run inside one."""
    task = args.task if args.task is not None else int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
    tasks = args.tasks if args.tasks is not None else int(os.environ.get("SLURM_ARRAY_TASK_COUNT", "1"))
    return task, tasks


def cmd_build(args: argparse.Namespace) -> int:
    from data_pipeline.build.config import load_build_config
    from data_pipeline.build.run import STAGES, run_build
    from framework.base.errors import ConfigError

    cfg = load_build_config(args.config, args.overrides)
    stages = tuple(args.stages.split(",")) if args.stages else STAGES
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"--stages {args.stages!r} names unknown stages {unknown}; stages: {STAGE_HELP}")
    task, tasks = _task_from_env(args)
    if not 0 <= task < tasks:
        raise ConfigError(f"--task {task} must be in [0, --tasks {tasks}); e.g. --task 0 --tasks 4")
    manifest = run_build(cfg, stages=stages, task=task, tasks=tasks)
    if manifest:
        print(format_stats(manifest))
        print(f"build written to {cfg.output_dir} (fingerprint {manifest['fingerprint'][:16]})")
    else:
        print(f"stages {','.join(stages)} done for task {task}/{tasks}; rerun without --stages to finish")
    return 0


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _table(rows: list[tuple[str, ...]], left: int = 1) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_stats(manifest: dict[str, Any], by_filter: bool = True) -> str:
    """Tables of a build's accounting: per source, documents, characters and tokens by outcome; then per source
    and filter rule, the documents, characters and tokens it removed (and what line rules trimmed from kept ones;
    tokens counted with the build's tokenizer, "~" where estimated from a sample: data_pipeline/removed_tokens)."""
    head = ("source", "in", "kept", "filtered", "exact dup", "near dup", "malformed", "chars in", "chars kept",
            "kept %", "tokens kept")
    rows: list[tuple[str, ...]] = [head]
    for name, src in sorted(manifest["sources"].items()):
        d, c = src["documents"], src.get("chars", {})
        kept_chars = c.get("kept", c.get("after_filters", 0))  # older builds: characters after filters
        rows.append((name, str(d["in"]), str(d["kept"]), str(sum(d["filtered"].values())), str(d["exact_duplicate"]),
                     str(d["near_duplicate"]), str(sum(d["malformed"].values())), f"{c.get('in', 0):,}",
                     f"{kept_chars:,}", _pct(kept_chars, c.get("in", 0)), f"{src['tokens']['kept']:,}"))
    lines = _table(rows)
    if by_filter:
        rows = [("source", "removed by", "documents", "characters", "of source chars", "tokens")]
        for name, src in sorted(manifest["sources"].items()):
            d, c, t = src["documents"], src.get("chars", {}), src["tokens"]
            total = c.get("in", 0)
            parts = [(f"filter {r}", n, c.get("filtered", {}).get(r, 0), t.get("filtered", {}).get(r))
                     for r, n in d["filtered"].items()]
            parts += [(f"trim {r}", 0, v, t.get("trimmed", {}).get(r)) for r, v in c.get("trimmed", {}).items()]
            parts += [(f"malformed {r}", n, c.get("malformed", {}).get(r, 0), None) for r, n in d["malformed"].items()]
            parts += [(k, d[k], c.get(k, 0), t[k]) for k in ("exact_duplicate", "near_duplicate") if d[k]]
            parts += [(f"decontaminated {b}", n, c.get("decontaminated", {}).get(b, 0), None)
                      for b, n in d.get("decontaminated", {}).items()]
            for what, n, chars, tokens in sorted(parts, key=lambda p: -p[2]):
                # "~": estimated from a sample of the removed text; "-": never tokenized (malformed records and
                # what normalization trims)
                approx = "~" if what.split(" ", 1)[-1] in t.get("estimated", ()) else ""
                rows.append((name, what, str(n) if n else "-", f"{chars:,}", _pct(chars, total),
                             "-" if tokens is None else f"{approx}{tokens:,}"))
        if len(rows) > 1:
            lines += ["", *_table(rows, left=2)]
    scored = {name: src["quality"] for name, src in sorted(manifest["sources"].items()) if src.get("quality")}
    if scored:  # the quality classifier's scores per source (data_pipeline/build/quality_scores.py)
        rows = [("source", "quality by", "scored", "min", "p10", "p50", "p90", "max", "cutoff", "kept")]
        rows += [(name, q["by"], str(q["count"]), *(f"{q[k]:.3f}" if k in q else "-"
                                                      for k in ("min", "p10", "p50", "p90", "max")),
                  "-" if q["cutoff"] is None else f"{q['cutoff']:.3f}", str(q["kept"])) for name, q in scored.items()]
        lines += ["", *_table(rows)]
    tok = manifest["tokenizer"]
    lines.append(f"tokenizer: vocab {tok['vocab_size']}, eos {tok['eos_id']}, sha256 {tok['sha256'][:16]}")
    if tok.get("languages"):  # measured on a sample of kept text; language told by script (script_stats)
        rows = [("language (by script)", "sample docs", "characters", "tokens", "tokens/char")]
        rows += [(lang, str(v["documents"]), f"{v['characters']:,}", f"{v['tokens']:,}",
                  f"{v['tokens'] / max(1, v['characters']):.3f}") for lang, v in tok["languages"].items()]
        lines += ["", *_table(rows)]
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    from data_pipeline.read.prepare import read_manifest

    manifest = read_manifest(args.build)
    print(json.dumps(manifest["sources"], indent=2) if args.json else format_stats(manifest))
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    """Decode a source's training documents (as tokenized in the build) or show the documents a filter removed."""
    from pathlib import Path

    from data_pipeline.indexed import IndexedTokens
    from data_pipeline.read.prepare import read_manifest
    from data_pipeline.tokenizer import Tokenizer
    from framework.base.errors import ConfigError

    build = Path(args.build)
    manifest = read_manifest(build)
    if args.source not in manifest["sources"]:
        raise ConfigError(f"--source {args.source!r} is not in {build} (sources: {sorted(manifest['sources'])})")
    if args.filtered or args.decontaminated:
        path = build / "work" / "ingest" / args.source / "filtered.jsonl"
        if not path.is_file():
            raise ConfigError(f"{path} is gone (work/ was deleted); rebuild to see what the filters removed")
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        if args.decontaminated:  # per benchmark: the documents removed, the characters masked, then examples
            src = manifest["sources"][args.source]
            removed, chars = src["documents"].get("decontaminated", {}), src["chars"].get("decontaminated", {})
            masked = {k.split(".", 1)[1]: v for k, v in src["chars"]["trimmed"].items()
                      if k.startswith("decontaminate.")}
            for b in sorted(set(removed) | set(masked)):
                print(f"{b}: {removed.get(b, 0)} documents removed ({chars.get(b, 0):,} characters), "
                      f"{masked.get(b, 0):,} characters of lines masked")
            rows = [r for r in rows if r["reason"].startswith("decontaminate.")]
        for r in rows if args.reason is None else [r for r in rows if r["reason"] == args.reason]:
            text = r.get("text") or ""
            cut = "" if len(text) <= args.chars else f"\n[... {r['chars'] - args.chars:,} more characters]"
            print(f"=== {r['reason']}: {r['where']} ({r['chars']:,} characters) ===\n{text[:args.chars]}{cut}")
        return 0
    tok = Tokenizer(build / Path(manifest["tokenizer"]["path"]).name)
    docs = IndexedTokens(build / args.source)
    import numpy as np

    picks = np.random.default_rng(args.seed).choice(len(docs), size=min(args.n, len(docs)), replace=False)
    for i in sorted(picks.tolist()):
        ids = docs[i].tolist()
        text = tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_id else ids)
        cut = "" if len(text) <= args.chars else f"\n[... {len(text) - args.chars:,} more characters]"
        print(f"=== {args.source} document {i} ({len(ids):,} tokens) ===\n{text[:args.chars]}{cut}")
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from data_pipeline.build.ingest import read_records
    from data_pipeline.tokenizer import Tokenizer, sample_lines, train_sentencepiece

    def texts() -> Any:
        for path in args.inputs:
            for rec in read_records(path, args.format, args.text_field, args.glob):
                if rec.text is not None:
                    yield rec.text

    lines = sample_lines(texts(), args.sample_chars, seed=args.seed)
    if args.type == "hf_bpe":
        from data_pipeline.tokenizer import train_hf_bpe

        out = train_hf_bpe(lines, args.out, vocab_size=args.vocab_size)
    else:
        out = train_sentencepiece(lines, args.out, vocab_size=args.vocab_size, model_type=args.type,
                                  threads=args.threads, character_coverage=args.character_coverage)
    info = Tokenizer(out).info()
    print(f"tokenizer {out}: vocab {info.vocab_size}, eos {info.eos_id}, bos {info.bos_id}, unk {info.unk_id}, "
          f"user symbols {list(info.user_symbols)!r}, trained on {sum(map(len, lines)):,} characters")
    return 0


def cmd_train_quality(args: argparse.Namespace) -> int:
    """Train a fastText quality classifier from positive and negative example sources (build/quality.py)."""
    import itertools

    from data_pipeline.build.ingest import read_records
    from data_pipeline.build.quality import load_classifier, score, train_quality

    def texts(paths: list[str]) -> list[str]:
        docs = (r.text for p in paths for r in read_records(p, args.format, args.text_field, args.glob))
        return list(itertools.islice((t for t in docs if t and t.strip()), args.max_docs))

    pos, neg = texts(args.positive), texts(args.negative)
    out = train_quality(pos, neg, args.out, epoch=args.epoch, lr=args.lr, seed=args.seed)
    model = load_classifier(str(out))
    mean = [sum(score(t, model) for t in xs) / len(xs) for xs in (pos, neg)]
    print(f"quality classifier {out}: {len(pos):,} positive and {len(neg):,} negative documents; mean score "
          f"{mean[0]:.3f} on the positives, {mean[1]:.3f} on the negatives (training data)")
    return 0


def register(subparsers: Any) -> None:
    """Add the `data` and `tokenizer` subcommands to the tessera CLI."""
    data = subparsers.add_parser("data", help="build and inspect tokenized datasets")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = dsub.add_parser("build", help="run (or resume) a data build from a YAML config")
    p.add_argument("config", help="build YAML, e.g. configs/data/example.yaml")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    p.add_argument("--stages", help=f"comma-separated subset of: {STAGE_HELP}")
    p.add_argument("--task", type=int, help="this task's index for sharded stages (default: SLURM_ARRAY_TASK_ID)")
    p.add_argument("--tasks", type=int, help="number of tasks (default: SLURM_ARRAY_TASK_COUNT)")
    p.set_defaults(func=cmd_build)
    p = dsub.add_parser("stats", help="per-source accounting table of a finished build")
    p.add_argument("build", help="the build's output directory")
    p.add_argument("--json", action="store_true", help="print the manifest's per-source JSON instead")
    p.set_defaults(func=cmd_stats)
    p = dsub.add_parser("sample", help="decode documents of a source, or list what its filters removed")
    p.add_argument("build", help="the build's output directory")
    p.add_argument("--source", required=True)
    p.add_argument("-n", type=int, default=3, help="documents to show (random, by --seed)")
    p.add_argument("--chars", type=int, default=2000, help="characters shown per document")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filtered", action="store_true", help="show the first documents each filter rule removed "
                                                            "(where they came from and their text, up to --chars), "
                                                            "kept in work/ingest/SOURCE")
    p.add_argument("--reason", help="with --filtered: only this rule, e.g. c4.too_few_sentences")
    p.add_argument("--decontaminated", action="store_true", help="per benchmark, the documents removed and the "
                                                                  "characters masked, and where they came from")
    p.set_defaults(func=cmd_sample)

    p = dsub.add_parser("train-quality", help="train a fastText quality classifier (for filters.quality.model) "
                                              "from positive and negative example sources")
    p.add_argument("--positive", nargs="+", required=True, help="sources of text to keep (files or directories)")
    p.add_argument("--negative", nargs="+", required=True, help="sources of text to drop")
    p.add_argument("--out", required=True, help="the .bin to write")
    p.add_argument("--format", default="auto", choices=("auto", "jsonl", "parquet", "hf", "text"))
    p.add_argument("--text-field", default="text")
    p.add_argument("--glob", default="*", help="text trees: which files are documents")
    p.add_argument("--max-docs", type=int, default=500_000, help="documents read per class")
    p.add_argument("--epoch", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.1, help="fastText's learning rate (raise it for a few hundred "
                                                         "examples)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_train_quality)

    tok = subparsers.add_parser("tokenizer", help="tokenizer tools")
    tsub = tok.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    p = tsub.add_parser("train", help="train a tokenizer (sentencepiece, or HF byte-level BPE) on text sources")
    p.add_argument("inputs", nargs="+", help="files or directories (jsonl[.gz|.zst], parquet, HF dataset, text tree)")
    p.add_argument("--out", required=True, help="output .model path (hf_bpe: tokenizer.json and "
                                                "tokenizer_config.json are written into this path's folder)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--type", choices=("bpe", "unigram", "hf_bpe"), default="bpe",
                   help="sentencepiece bpe/unigram, or a byte-level BPE trained with HF tokenizers")
    p.add_argument("--format", default="auto", choices=("auto", "jsonl", "parquet", "hf", "text"))
    p.add_argument("--text-field", default="text")
    p.add_argument("--glob", default="*", help="text trees: which files are documents")
    p.add_argument("--sample-chars", type=int, default=10_000_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--character-coverage", type=float, default=None,
                   help="sentencepiece: share of characters given pieces (default: 0.9995 for Chinese, Japanese or "
                        "Korean text, else 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tokenizer_train)


__all__ = ["format_stats", "register"]
