"""Builds that notice config edits: every unit of a build's work carries a key of exactly the settings it depends
on, stored in `work/stamps.json`; a rerun with an edited config deletes (and so redoes) just the units whose key
changed, and says which. The dependency table (docs/DATA.md):

    ingest/<s>    source s's own settings (path, format, fields, split, glob, its filters and their
                  parameters, filters.units, filters.decontaminate and its files' bytes, its effective
                  normalization), shard_docs and unit_bytes
    exact         every ingest key, every priority, dedup.exact and dedup.partition_docs
    minhash/<s>   ingest/<s> and the signature settings (ngram, bands, rows, seed, scheme)
    bands/<s>     minhash/<s>, exact (exact duplicates get no band keys) and probe
    near          exact, every bands key, dedup.near and the rest of dedup (pairs, verify and near)
    tokenizer     a given tokenizer file's bytes; or (trained) near, the tokenizer settings (its training
                  threads included) and seed
    tokenize/<s>  tokenizer and near (the kept documents of every source can change with any source's filter)
    merge/<s>     tokenize/<s> and merge_bytes (redoing it deletes the source's .bin/.idx/.hash.npy and the
                  manifest)
    manifest      all of the above

`workers`, `rejects` and other keys nothing reads into the data are cosmetic: editing them redoes nothing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from data_pipeline.build.cache import MANIFEST, config_key, write_json_atomic
from data_pipeline.build.config import BuildConfig
from data_pipeline.build.filters import resolve_filters
from data_pipeline.build.quality import model_files
from framework.base.yaml_config import to_dict

STAMPS = "stamps.json"
INGEST_VERSION = 6
"""Bump when ingest's output for the same settings changes (a new filter rule, the per-document `where`; 3: ingest
units and sorted hashes; 4: byte-range units of a jsonl file, row-group and row-range units; 5: words of scripts
without spaces counted per character, data_pipeline/text_units.py; 6: the binary
rule before normalization, templated headers kept as code, docs word lengths without URLs and markup)."""
MERGE_VERSION = 1
"""Bump when the merge stage's files under work/merge change (1: units writing in place,
data_pipeline/build/merge.py)."""


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def stage_keys(cfg: BuildConfig) -> dict[str, str]:
    """The key of every unit of work of a build (see the module docstring)."""
    keys: dict[str, str] = {}
    mh = to_dict(cfg.dedup.minhash)
    dc = cfg.filters.decontaminate
    decontam = {**to_dict(dc), "files": [file_sha256(b) for b in dc.benchmarks]} if dc.benchmarks else None
    for src in cfg.sources:
        names = resolve_filters(src.filters, src.profile)
        own = {k: v for k, v in to_dict(src).items() if k not in ("priority", "normalize")}
        keys[f"ingest/{src.name}"] = config_key({
            "v": INGEST_VERSION, "source": own, "filters": names, "shard_docs": cfg.shard_docs,
            "unit_bytes": cfg.unit_bytes, "params": {n: to_dict(getattr(cfg.filters, n)) for n in (*names, "binary")},
            "normalize": to_dict(cfg.source_normalize(src)), "units": to_dict(cfg.filters.units),
            **({"decontaminate": decontam} if decontam else {}),
            **({"quality_model": [file_sha256(f) for f in model_files(cfg.filters.quality.model)]}
               if "quality" in names and cfg.filters.quality.model else {})})
    ingest = [[s.name, s.priority, keys[f"ingest/{s.name}"]] for s in cfg.sources]
    keys["exact"] = config_key([ingest, cfg.dedup.exact, cfg.dedup.partition_docs])
    for src in cfg.sources:
        keys[f"minhash/{src.name}"] = config_key([keys[f"ingest/{src.name}"], mh["ngram"], mh["bands"], mh["rows"],
                                                  mh["seed"], mh["scheme"]])
        keys[f"bands/{src.name}"] = config_key([keys[f"minhash/{src.name}"], keys["exact"], mh["probe"]])
    keys["near"] = config_key([keys["exact"], [keys[f"bands/{s.name}"] for s in cfg.sources],
                               to_dict(cfg.dedup)])
    tok = to_dict(cfg.tokenizer)
    if tok.get("model"):
        side = Path(tok["model"]).with_name("tokenizer_config.json")
        keys["tokenizer"] = config_key({"file": file_sha256(tok["model"]), **tok, "model": None,
                                        "config": file_sha256(side) if side.is_file() else None})
    else:
        keys["tokenizer"] = config_key([keys["near"], tok, cfg.seed])
    for src in cfg.sources:
        keys[f"tokenize/{src.name}"] = config_key([keys["tokenizer"], keys["near"]])
        keys[f"merge/{src.name}"] = config_key([keys[f"tokenize/{src.name}"], MERGE_VERSION,
                                                cfg.merge_bytes])
    keys["manifest"] = config_key([keys["near"], keys["tokenizer"], [s.name for s in cfg.sources]])
    return keys


def _outputs(unit: str, out: Path) -> list[Path]:
    work = out / "work"
    stage, _, source = unit.partition("/")
    if stage in ("ingest", "minhash", "bands"):
        return [work / stage / source]
    if stage == "tokenize":
        return [work / "tokens" / source]
    if stage == "merge":
        return [work / "merge" / source, *(out / f"{source}{ext}" for ext in (".bin", ".idx", ".hash.npy")),
                out / MANIFEST]
    return {"exact": [work / "exact"],
            "near": [work / "pairs", work / "verify", work / "near", out / "cluster_report.json",
                     out / "near_duplicates.jsonl"],
            "tokenizer": [out / p for p in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                             "tokenizer.tiktoken")],
            "manifest": [out / MANIFEST]}[stage]


def read_stamps(out: Path) -> dict[str, str]:
    path = out / "work" / STAMPS
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def invalidate(cfg: BuildConfig, out: Path) -> list[str]:
    """Delete the outputs of every unit whose key changed since the last run on `out` (a build that predates
    stamps counts as all changed), record the new keys, and return the changed units (empty: nothing to redo)."""
    new = stage_keys(cfg)
    work = out / "work"
    has_work = (work.is_dir() and any(work.iterdir())) or (out / MANIFEST).is_file()
    old = read_stamps(out) if has_work else dict(new)
    changed = [u for u in new if old.get(u) != new[u]]
    gone = [u for u in old if u not in new]  # sources removed from the config
    for unit in changed + gone:
        for path in _outputs(unit, out):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    for unit in gone:
        _, _, source = unit.partition("/")
        for ext in (".bin", ".idx", ".hash.npy"):
            (out / f"{source}{ext}").unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    write_json_atomic(work / STAMPS, new)
    return changed + gone


def describe_changes(units: list[str]) -> str:
    return ", ".join(units) if units else "nothing"


__all__ = ["STAMPS", "describe_changes", "invalidate", "read_stamps", "stage_keys"]
