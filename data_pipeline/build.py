"""`run_build`: raw sources -> normalize/filter -> exact dedup -> near dedup -> tokenizer -> .bin/.idx + manifest.

Stages run in order and each resumes: rerunning an interrupted build skips finished work and never writes a
finished output twice. The manifest is written last; its presence marks a complete build. Shardable stages
(minhash, tokenize) take `task`/`tasks` so a SLURM job array can split them across nodes; the others run once.
Before any stage, every source and the tokenizer file are checked (`check_build`), and a config edited since
the last run redoes exactly the units of work it affects (`invalidate`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build_config import BuildConfig
from data_pipeline.cache import MANIFEST, write_json_atomic
from data_pipeline.dedup import cluster_signatures, exact_keep
from data_pipeline.indexed import IndexedTokens, merge_indexed
from data_pipeline.ingest import (
    hf_columns,
    input_files,
    list_text_files,
    parquet_columns,
    resolve_format,
)
from data_pipeline.invalidate import describe_changes, invalidate
from data_pipeline.minhash import shingle_hashes
from data_pipeline.progress import log
from data_pipeline.removed_tokens import count_removed_tokens
from data_pipeline.stages import (
    REMOVED_SAMPLE,
    ingest_source,
    list_shards,
    minhash_shards,
    read_shard_texts,
    read_shard_where,
    save_npy_atomic,
    tokenize_shards,
)
from data_pipeline.tokenizer import (
    CL100K_PATTERN,
    Tokenizer,
    sample_lines,
    tiktoken_to_hf,
    tokenizer_kind,
    train_hf_bpe,
    train_sentencepiece,
)
from framework.config.core import to_dict
from framework.errors import ConfigError, DataError
from framework.locks import build_locks

STAGES = ("ingest", "exact", "minhash", "near", "tokenizer", "tokenize", "manifest")


class _Corpus:
    """Flat view over every ingested shard: global document index <-> (source, shard, row)."""

    def __init__(self, cfg: BuildConfig, work: Path) -> None:
        self.work = work
        self.shards: list[tuple[str, Path, int]] = []  # (source, shard path, first global index)
        self.priority_parts, n = [], 0
        for src in cfg.sources:
            for shard in list_shards(work, "ingest", src.name, ".hash.npy"):
                count = len(np.load(shard, mmap_mode="r"))
                self.shards.append((src.name, shard, n))
                self.priority_parts.append(np.full(count, src.priority, dtype=np.int64))
                n += count
        self.n = n
        self.starts = np.array([s[2] for s in self.shards] + [n], dtype=np.int64)
        self._cache: dict[int, list[str]] = {}

    def priority(self) -> np.ndarray:
        return np.concatenate(self.priority_parts) if self.priority_parts else np.zeros(0, dtype=np.int64)

    def load(self, suffix_from: str, suffix_to: str, stage: str) -> np.ndarray:
        parts = []
        for name, shard, _ in self.shards:
            path = self.work / stage / name / shard.name.replace(suffix_from, suffix_to)
            if not path.is_file():
                raise DataError(f"{path} is missing: the {stage} stage has not finished for every shard; run "
                                f"`tessera data build CONFIG --stages {stage}` (all tasks) first")
            parts.append(np.load(path, mmap_mode="r"))
        return np.concatenate(parts) if parts else np.zeros(0)

    def texts(self, ids: np.ndarray) -> list[str]:
        out = []
        for i in ids.tolist():
            s = int(np.searchsorted(self.starts, i, side="right")) - 1
            if s not in self._cache:
                if len(self._cache) > 8:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[s] = read_shard_texts(self.shards[s][1].with_name(
                    self.shards[s][1].name.replace(".hash.npy", ".jsonl")))
            out.append(self._cache[s][i - int(self.starts[s])])
        return out

    def names(self, ids: np.ndarray) -> list[str]:
        """`source:where` of documents (where: the file and line it was read from)."""
        out, wheres = [], {}
        for i in ids.tolist():
            s = int(np.searchsorted(self.starts, i, side="right")) - 1
            if s not in wheres:
                wheres[s] = read_shard_where(self.shards[s][1].with_name(
                    self.shards[s][1].name.replace(".hash.npy", ".jsonl")))
            out.append(f"{self.shards[s][0]}:{wheres[s][i - int(self.starts[s])]}")
        return out

    def split(self, flat: np.ndarray) -> dict[str, list[np.ndarray]]:
        """A flat per-document array cut back into per-source lists of per-shard arrays."""
        out: dict[str, list[np.ndarray]] = {}
        for k, (name, _, start) in enumerate(self.shards):
            out.setdefault(name, []).append(np.asarray(flat[start:int(self.starts[k + 1])]))
        return out


def _exact(cfg: BuildConfig, corpus: _Corpus, work: Path) -> np.ndarray:
    path = work / "exact_keep.npy"
    if not path.is_file():
        hashes = corpus.load(".hash.npy", ".hash.npy", "ingest")
        keep = exact_keep(hashes, corpus.priority()) if cfg.dedup.exact else np.ones(corpus.n, dtype=bool)
        save_npy_atomic(path, keep)
    return np.load(path)


def _near(cfg: BuildConfig, corpus: _Corpus, work: Path, exact: np.ndarray) -> np.ndarray:
    path = work / "near_keep.npy"
    if path.is_file():
        return np.load(path)
    keep = np.ones(corpus.n, dtype=bool)
    if cfg.dedup.near and corpus.n:
        ids = np.flatnonzero(exact)  # exact duplicates are already gone
        sig = corpus.load(".hash.npy", ".sig.npy", "minhash")[ids]
        mh = cfg.dedup.minhash

        def shingles_of(local: np.ndarray) -> list[np.ndarray]:
            h, off = shingle_hashes(corpus.texts(ids[local]), mh.ngram)
            return [h[off[k]:off[k + 1]] for k in range(len(local))]

        result = cluster_signatures(sig, mh, priority=corpus.priority()[ids], shingles_of=shingles_of)
        keep[ids[~result.keep]] = False
        names = corpus.names(ids)
        write_json_atomic(work.parent / "cluster_report.json", result.report(names=names))
    save_npy_atomic(path, keep)
    return keep


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def _tokenizer(cfg: BuildConfig, corpus: _Corpus, out: Path, keep: np.ndarray) -> Path:
    """The build's tokenizer file (out/tokenizer.model or out/tokenizer.json): reused, copied, converted or
    trained. Made in a temporary folder and moved in only once it loads, so a failed step leaves nothing that a
    later run would take for a finished tokenizer."""
    for name in TOKENIZER_FILES:
        if (out / name).is_file():
            return out / name
    tc = cfg.tokenizer
    tmp = out / f".tokenizer.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if tc.model:
            made = _given_tokenizer(cfg, tmp)
        else:
            kept = np.flatnonzero(keep)
            rng = np.random.default_rng(cfg.seed)
            order = kept[rng.permutation(len(kept))]  # a uniform sample over sources, in proportion to documents
            texts = (t for start in range(0, len(order), 512)
                     for t in corpus.texts(np.sort(order[start:start + 512])))
            lines = sample_lines(texts, tc.sample_chars, seed=cfg.seed)
            if tc.type == "hf_bpe":
                made = train_hf_bpe(lines, tmp / "tokenizer.json", vocab_size=tc.vocab_size,
                                    special_tokens=tc.special_tokens)
                _name_specials(tmp, tc)
            else:
                made = train_sentencepiece(lines, tmp / "tokenizer.model", vocab_size=tc.vocab_size,
                                           model_type=tc.type, threads=cfg.workers)
        Tokenizer(made)
        for f in sorted(tmp.iterdir(), key=lambda p: p.name in TOKENIZER_FILES):  # the tokenizer file last
            f.replace(out / f.name)
        return out / made.name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _name_specials(folder: Path, tc: Any) -> None:
    conf_path = folder / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text())
    conf["eos_token"] = tc.eos_token or (tc.special_tokens[0] if tc.special_tokens else None)
    conf["bos_token"] = tc.bos_token
    conf_path.write_text(json.dumps(conf))


def _given_tokenizer(cfg: BuildConfig, folder: Path) -> Path:
    """cfg.tokenizer.model copied (or, for a tiktoken file, converted) into `folder`."""
    tc = cfg.tokenizer
    src = Path(str(tc.model))
    kind = tokenizer_kind(src)
    if kind == "tiktoken":
        return tiktoken_to_hf(src, folder, pattern=tc.pattern or CL100K_PATTERN, special_tokens=tc.special_tokens,
                              eos_token=tc.eos_token, bos_token=tc.bos_token)
    if kind == "hf":
        shutil.copyfile(src, folder / "tokenizer.json")
        if (src.parent / "tokenizer_config.json").is_file():
            shutil.copyfile(src.parent / "tokenizer_config.json", folder / "tokenizer_config.json")
        return folder / "tokenizer.json"
    shutil.copyfile(src, folder / "tokenizer.model")
    return folder / "tokenizer.model"


def check_tokenizer(cfg: BuildConfig) -> None:
    """A given tokenizer file exists and loads (a tiktoken file: parses, and converts in a scratch folder)."""
    path = cfg.tokenizer.model
    if not path:
        return
    if not Path(path).is_file():
        raise ConfigError(f"tokenizer.model={path!r} does not exist; fix the path, or leave it unset to train one")
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            Tokenizer(_given_tokenizer(cfg, Path(tmp)))
    except Exception as err:
        raise ConfigError(f"tokenizer.model={path!r} does not load as a tokenizer ({err}); point it at a "
                          f"sentencepiece .model, a tokenizer.json or a tiktoken-format BPE file") from err


def _source_entry(counts: dict[str, Any], status: list[np.ndarray], stats: list[dict[str, Any]],
                  removed: dict[str, Any]) -> dict[str, Any]:
    """A source's accounting: documents and characters each by outcome (the invariant in = kept + filtered +
    duplicates + malformed, plus for characters what normalization and line rules trimmed, is checked), tokens
    of the tokenized outcomes and of what each filter removed (`removed`, from removed_tokens), and notes
    (documents kept with a caveat, e.g. an encoding fallback)."""
    st = np.concatenate(status) if status else np.zeros(0, dtype=np.int8)
    outcomes = ("kept", "exact_duplicate", "near_duplicate")
    docs = {"in": counts["in"], "kept": int((st == 0).sum()), "filtered": counts["filtered"],
            "exact_duplicate": int((st == 1).sum()), "near_duplicate": int((st == 2).sum()),
            "malformed": counts["malformed"]}
    c = counts["chars"]
    chars = {"in": c["in"], **{k: sum(s["chars"][k] for s in stats) for k in outcomes}, "filtered": c["filtered"],
             "malformed": c["malformed"], "trimmed": c["trimmed"]}
    for what, d, extra in (("documents", docs, 0), ("characters", chars, sum(chars["trimmed"].values()))):
        total = d["kept"] + sum(d["filtered"].values()) + d["exact_duplicate"] + d["near_duplicate"] + \
            sum(d["malformed"].values()) + extra
        if total != d["in"]:
            raise DataError(f"accounting broken ({what}): in={d['in']} but kept + filtered + duplicate + malformed"
                            f"{' + trimmed' if extra else ''} = {total} ({d}); this is a bug in the build — report "
                            f"it with the config")
    tokens = {k: sum(s[k] for s in stats) for k in outcomes} | removed
    return {"documents": docs, "tokens": tokens, "chars": chars, "notes": counts.get("notes", {})}


def _finish(cfg: BuildConfig, out: Path, work: Path, corpus: _Corpus, status: dict[str, list[np.ndarray]],
            all_counts: dict[str, dict[str, Any]], model: Path) -> dict[str, Any]:
    tok = Tokenizer(model)
    info = tok.info()
    digest = hashlib.sha256(info.sha256.encode())
    sources: dict[str, Any] = {}
    for src in cfg.sources:
        shards = list_shards(work, "tokens", src.name, ".idx")
        prefixes = [str(p)[:-4] for p in shards]
        merge_indexed(prefixes, out / src.name, tok.vocab_size)
        hashes = [np.load(p)[s == 0] for p, s in zip(
            list_shards(work, "ingest", src.name, ".hash.npy"), status.get(src.name, []), strict=True)]
        all_hashes = np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)
        save_npy_atomic(out / f"{src.name}.hash.npy", all_hashes)
        if len(IndexedTokens(out / src.name)) != len(all_hashes):
            raise DataError(f"{src.name}: token file and hash list disagree; delete {work} and rebuild")
        stats = [json.loads(Path(p + ".stats.json").read_text()) for p in prefixes]
        removed = count_removed_tokens(sorted((work / "ingest" / src.name).glob(REMOVED_SAMPLE)), tok)
        sources[src.name] = _source_entry(all_counts[src.name], status.get(src.name, []), stats, removed)
        digest.update(f"{src.name}:{sources[src.name]['tokens']['kept']}:".encode() + all_hashes.tobytes())
    manifest = {"version": 1, "kind": "build", "config": to_dict(cfg), "sources": sources,
                "tokenizer": {**info.__dict__, "path": model.name, "kind": tok.kind}, "fingerprint": digest.hexdigest()}
    write_json_atomic(out / MANIFEST, manifest)
    return dict(json.loads((out / MANIFEST).read_text()))


def check_build(cfg: BuildConfig) -> None:
    """Check every source and the tokenizer file before the first stage starts (ConfigError naming the source):
    the path exists, its format can be told, it holds files to read, the text field or column exists, the split
    exists; a given tokenizer file loads."""
    for src in cfg.sources:
        where = f"sources[{src.name}]"
        try:
            fmt = resolve_format(src.path, src.format)
            path = Path(os.path.expanduser(src.path))
            if src.hf_builder is not None:
                continue
            if fmt == "text":
                if not list_text_files(path, src.glob):
                    raise ConfigError(f"no file under {src.path!r} matches glob={src.glob!r}; fix the glob")
            elif fmt == "hf":
                columns = hf_columns(path, src.split)
                if src.text_field not in columns:
                    raise ConfigError(f"{src.path} has no column {src.text_field!r} (columns: {columns}); set "
                                      f"text_field")
            else:
                files = input_files(path, fmt)
                if not files:
                    raise ConfigError(f"{src.path!r} holds no {fmt} files; fix the path or format")
                if fmt == "parquet":
                    for f in files:
                        try:
                            columns = parquet_columns(f)
                        except Exception:
                            continue  # an unreadable file is counted as malformed at ingest, not fatal
                        if src.text_field not in columns:
                            raise ConfigError(f"{f} has no column {src.text_field!r} (columns: {columns}); set "
                                              f"the source's text_field to the column holding the text")
        except (ConfigError, DataError) as err:
            raise ConfigError(f"{where}: {err}") from err
    check_tokenizer(cfg)


def run_build(cfg: BuildConfig, *, stages: Sequence[str] = STAGES, task: int = 0, tasks: int = 1) -> dict[str, Any]:
    """Run (or resume) a build; returns the manifest (empty when `stages` stops before it).

    Args:
        cfg: The build configuration.
        stages: Which stages to run (a SLURM array runs `minhash` or `tokenize` alone, per task).
        task: This task's index among `tasks` for the shardable stages.
        tasks: Number of tasks sharing the shardable stages.
    """
    out = Path(cfg.output_dir)
    check_build(cfg)
    _locks = build_locks(out, stages, task)  # held until this function returns (framework/locks.py)
    changed = invalidate(cfg, out)
    if changed:
        log(f"build {out}: config differs from the last run there; redoing {describe_changes(changed)}")
    if (out / MANIFEST).is_file() and "manifest" in stages:
        return dict(json.loads((out / MANIFEST).read_text()))
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    all_counts = {}
    for i, src in enumerate(cfg.sources):
        if "ingest" in stages and i % tasks == task:
            all_counts[src.name] = ingest_source(cfg, src, work)
    if "minhash" in stages and cfg.dedup.near:
        minhash_shards(cfg, work, task, tasks)
    if not {"exact", "near", "tokenizer", "tokenize", "manifest"} & set(stages):
        return {}
    corpus = _Corpus(cfg, work)
    exact = _exact(cfg, corpus, work)
    near = _near(cfg, corpus, work, exact) if "near" in stages or (work / "near_keep.npy").is_file() else None
    if near is None:
        return {}
    status_flat = np.where(~exact, 1, np.where(~near, 2, 0)).astype(np.int8)
    status = corpus.split(status_flat)
    model = _tokenizer(cfg, corpus, out, status_flat == 0)
    if "tokenize" in stages:
        tokenize_shards(cfg, work, model, status, task, tasks)
    if "manifest" not in stages:
        return {}
    for src in cfg.sources:
        all_counts.setdefault(src.name, json.loads((work / "ingest" / src.name / "counts.json").read_text()))
    return _finish(cfg, out, work, corpus, status, all_counts, model)
