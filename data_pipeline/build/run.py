"""`run_build`: raw sources -> normalize/filter -> exact dedup -> near dedup -> tokenizer -> tokens -> merged .bin/.idx
-> manifest.

Stages run in order and each resumes: rerunning an interrupted build skips finished work and never writes a
finished output twice. The manifest is written last; its presence marks a complete build. The sharded stages
(SHARDED) take `task`/`tasks` so a SLURM job array splits them across nodes, each task's share running in worker
processes; near, tokenizer and manifest run in task 0 only (the manifest stage sums what the merge units
recorded and moves their files into place: data_pipeline/build/merge.py). The output never depends on the task count.
Before any stage, every source and the tokenizer file are checked (`check_build`), and a config edited since
the last run redoes exactly the units of work it affects (`invalidate`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.cache import MANIFEST, write_json_atomic
from data_pipeline.build.config import BuildConfig
from data_pipeline.build.decontam import split_counts
from data_pipeline.build.exact_stage import exact_stage
from data_pipeline.build.ingest import (
    hf_columns,
    input_files,
    list_text_files,
    parquet_columns,
    resolve_format,
)
from data_pipeline.build.ingest_stage import REMOVED_SAMPLE, ingest_stage
from data_pipeline.build.invalidate import describe_changes, invalidate
from data_pipeline.build.merge import OUTCOMES, finish_source, hash_digest, merge_stage, source_merges
from data_pipeline.build.minhash_stage import minhash_stage
from data_pipeline.build.near_stage import document_status, near_stage
from data_pipeline.build.pairs_stage import pairs_stage
from data_pipeline.build.progress import log
from data_pipeline.build.removed_tokens import count_removed_tokens
from data_pipeline.build.shard_files import read_shard_texts
from data_pipeline.build.shards import CorpusIndex
from data_pipeline.build.shingles import mix64
from data_pipeline.build.tokenize_stage import load_tokenizer, tokenize_shards
from data_pipeline.build.verify_stage import verify_stage
from data_pipeline.script_stats import tokens_by_language
from data_pipeline.tokenizer import (
    CL100K_PATTERN,
    TIKTOKEN_RANKS,
    Tokenizer,
    sample_lines,
    tiktoken_to_hf,
    tokenizer_kind,
    train_hf_bpe,
    train_sentencepiece,
)
from framework.base.errors import ConfigError, DataError
from framework.base.locks import build_locks
from framework.base.yaml_config import to_dict

STAGES = ("ingest", "exact", "minhash", "pairs", "verify", "near", "tokenizer", "tokenize", "merge", "manifest")
SHARDED = ("ingest", "exact", "minhash", "pairs", "verify", "tokenize", "merge")
"""Stages whose work `--task K --tasks N` splits; the others (near, tokenizer, manifest) run in one task."""


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def _tokenizer(cfg: BuildConfig, index: CorpusIndex, out: Path) -> Path:
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
            lines = sample_lines(_sample_texts(cfg, index), tc.sample_chars, seed=cfg.seed)
            if tc.type == "hf_bpe":
                made = train_hf_bpe(lines, tmp / "tokenizer.json", vocab_size=tc.vocab_size,
                                    special_tokens=tc.special_tokens)
                _name_specials(tmp, tc)
            else:
                made = train_sentencepiece(lines, tmp / "tokenizer.model", vocab_size=tc.vocab_size,
                                           model_type=tc.type, threads=tc.threads,
                                           character_coverage=tc.character_coverage)
        Tokenizer(made)
        for f in sorted(tmp.iterdir(), key=lambda p: p.name in TOKENIZER_FILES):  # the tokenizer file last
            f.replace(out / f.name)
        return out / made.name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _existing_tokenizer(out: Path) -> Path:
    for name in TOKENIZER_FILES:
        if (out / name).is_file():
            return out / name
    raise DataError(f"{out} has no tokenizer yet; run `tessera data build CONFIG --stages tokenizer` (one task) "
                    f"first")


def _sample_texts(cfg: BuildConfig, index: CorpusIndex) -> list[str]:
    """A uniform sample of the kept documents, about twice `tokenizer.sample_chars`, in random order: each kept
    document is taken iff a seeded mix of its hash falls under p = 2 x sample_chars / characters after filters
    (one pass over the shards; memory bounded by the sample, not the corpus)."""
    total = sum(json.loads((index.work / "ingest" / s.name / "counts.json").read_text())["chars"]["after_filters"]
                for s in cfg.sources)
    p = min(1.0, 2 * cfg.tokenizer.sample_chars / max(1, total))
    cut = np.uint64(min(_U64_MAX, int(p * 2.0 ** 64)))
    salt = mix64(np.array([cfg.seed + 0x5EED], dtype=np.uint64))[0]
    picked: list[str] = []
    for shard in index.shards:
        hashes = np.load(shard.file("ingest", ".hash.npy"))
        rows = np.flatnonzero((document_status(index, shard) == 0) & (mix64(hashes ^ salt) <= cut))
        if len(rows):  # only the picked lines decoded: a whole shard's texts would be the stage's peak
            picked.extend(read_shard_texts(shard.jsonl, rows.tolist()))
    order = np.random.default_rng(cfg.seed).permutation(len(picked))
    return [picked[i] for i in order.tolist()]


_U64_MAX = (1 << 64) - 1
LANGUAGE_SAMPLE_CHARS = 100_000
"""About half the characters of kept text (a uniform sample) that the manifest's tokens per character by language
are measured on."""


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
    if kind == "tiktoken":  # the ranks kept beside the tokenizer.json: the tokenize stage encodes with tiktoken
        made = tiktoken_to_hf(src, folder, pattern=tc.pattern or CL100K_PATTERN, special_tokens=tc.special_tokens,
                              eos_token=tc.eos_token, bos_token=tc.bos_token)
        shutil.copyfile(src, folder / TIKTOKEN_RANKS)
        return made
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


def _source_entry(counts: dict[str, Any], outcomes: dict[str, int], stats: list[dict[str, Any]],
                  removed: dict[str, Any]) -> dict[str, Any]:
    """A source's accounting: documents and characters each by outcome (the invariant in = kept + filtered +
    duplicates + malformed + decontaminated (per benchmark, when any), plus for characters what normalization,
    line rules and decontamination's mask trimmed, is checked), tokens
    of the tokenized outcomes and of what each filter removed (`removed`, from removed_tokens), and notes
    (documents kept with a caveat, e.g. an encoding fallback). `outcomes`: documents kept, exact and near
    duplicates; `stats`: tokens and characters by outcome, in parts that add up (the merge units')."""
    filtered, decontaminated = split_counts(counts["filtered"])
    docs = {"in": counts["in"], "kept": outcomes["kept"], "filtered": filtered,
            "exact_duplicate": outcomes["exact_duplicate"], "near_duplicate": outcomes["near_duplicate"],
            "malformed": counts["malformed"], **({"decontaminated": decontaminated} if decontaminated else {})}
    c = counts["chars"]
    c_filtered, c_decontaminated = split_counts(c["filtered"])
    chars = {"in": c["in"], **{k: sum(s["chars"][k] for s in stats) for k in OUTCOMES}, "filtered": c_filtered,
             "malformed": c["malformed"], "trimmed": c["trimmed"],
             **({"decontaminated": c_decontaminated} if c_decontaminated else {})}
    for what, d, extra in (("documents", docs, 0), ("characters", chars, sum(chars["trimmed"].values()))):
        total = d["kept"] + sum(d["filtered"].values()) + d["exact_duplicate"] + d["near_duplicate"] + \
            sum(d["malformed"].values()) + sum(d.get("decontaminated", {}).values()) + extra
        if total != d["in"]:
            raise DataError(f"accounting broken ({what}): in={d['in']} but kept + filtered + duplicate + malformed"
                            f" + decontaminated{' + trimmed' if extra else ''} = {total} ({d}); this is a bug in the "
                            f"build — report "
                            f"it with the config")
    tokens = {k: sum(s[k] for s in stats) for k in OUTCOMES} | removed
    return {"documents": docs, "tokens": tokens, "chars": chars, "notes": counts.get("notes", {}),
            **({"quality": counts["quality"]} if "quality" in counts else {})}


def _finish(cfg: BuildConfig, out: Path, index: CorpusIndex, all_counts: dict[str, dict[str, Any]],
            model: Path) -> dict[str, Any]:
    """The manifest stage (one task, after every merge unit): each source's merged files moved into place
    (merge.finish_source), its accounting summed from the merge units, the fingerprint over the tokenizer, each
    source's kept tokens and its kept documents' hashes; manifest.json written last. Memory: O(shards)."""
    tok = Tokenizer(model)
    info = tok.info()
    digest = hashlib.sha256(info.sha256.encode())
    sources: dict[str, Any] = {}
    for m in source_merges(index, out, tok.vocab_size):
        records = finish_source(m, index)
        outcomes = {k: sum(r["documents"][k] for r in records) for k in OUTCOMES}
        removed = count_removed_tokens(sorted((index.work / "ingest" / m.name).glob(REMOVED_SAMPLE)), tok)
        sources[m.name] = _source_entry(all_counts[m.name], outcomes, [r["stats"] for r in records], removed)
        digest.update(f"{m.name}:{sources[m.name]['tokens']['kept']}:".encode())
        hash_digest(m.final(".hash.npy"), digest)
    sample = _sample_texts(replace(cfg, tokenizer=replace(cfg.tokenizer, sample_chars=LANGUAGE_SAMPLE_CHARS)), index)
    languages = tokens_by_language(sample, lambda texts: [ids[:-1] for ids in tok.encode_docs(texts)])
    manifest = {"version": 1, "kind": "build", "config": to_dict(cfg), "sources": sources,
                "tokenizer": {**info.__dict__, "path": model.name, "kind": tok.kind, "languages": languages},
                "fingerprint": digest.hexdigest()}
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
        stages: Which stages to run (a SLURM array runs one sharded stage per job: docs/DATA.md, "Sharding").
        task: This task's index among `tasks` for the sharded stages (the others run only in task 0).
        tasks: Number of tasks sharing the sharded stages.
    """
    out = Path(cfg.output_dir)
    check_build(cfg)
    locks = build_locks(out, stages, task)  # framework/base/locks.py
    try:
        return _run_stages(cfg, out, stages, task, tasks)
    finally:
        locks.release()


def _run_stages(cfg: BuildConfig, out: Path, stages: Sequence[str], task: int, tasks: int) -> dict[str, Any]:
    changed = invalidate(cfg, out)
    if changed:
        log(f"build {out}: config differs from the last run there; redoing {describe_changes(changed)}")
    if (out / MANIFEST).is_file() and "manifest" in stages:
        return dict(json.loads((out / MANIFEST).read_text()))
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if "ingest" in stages:
        ingest_stage(cfg, work, task, tasks)
    if set(stages) <= {"ingest"}:
        return {}
    index = CorpusIndex(cfg, work)
    for stage, run in (("exact", exact_stage), ("minhash", minhash_stage), ("pairs", pairs_stage),
                       ("verify", verify_stage)):
        if stage in stages:
            run(index, task, tasks)
    if "near" in stages and cfg.dedup.near and task == 0:
        near_stage(index, out)
    if not {"tokenizer", "tokenize", "merge", "manifest"} & set(stages):
        return {}
    model = _tokenizer(cfg, index, out) if "tokenizer" in stages and task == 0 else _existing_tokenizer(out)
    if "tokenize" in stages:
        tokenize_shards(cfg, model, [(s.jsonl, s.file("tokens", "")) for s in index.shards],
                        lambda k: document_status(index, index.shards[k]), task, tasks)
    if "merge" in stages:
        merge_stage(index, out, load_tokenizer(str(model)).vocab_size, task, tasks)
    if "manifest" not in stages or task != 0:
        return {}
    all_counts = {src.name: json.loads((work / "ingest" / src.name / "counts.json").read_text())
                  for src in cfg.sources}
    return _finish(cfg, out, index, all_counts, model)
