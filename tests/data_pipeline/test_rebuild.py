"""Builds that notice config edits: each of three edits — the tokenizer only, one source's filters, a cosmetic
key — redoes exactly the units the dependency table (data_pipeline/build/invalidate.py, docs/DATA.md) names, and the
result equals a fresh build of the edited config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.invalidate import stage_keys
from data_pipeline.build.run import run_build
from framework.base.errors import ConfigError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _files(build: Path) -> dict[str, Path]:
    """One file per unit of work, whose rewrite shows the unit ran."""
    w = build / "work"
    return {"ingest/a": w / "ingest/a/counts.json", "ingest/b": w / "ingest/b/counts.json",
            "minhash/a": w / "minhash/a/shard-00000-00000.sig.npy",
            "minhash/b": w / "minhash/b/shard-00000-00000.sig.npy",
            "exact": w / "exact/part-00000.npy", "near": w / "near/summary.json",
            "tokenizer": build / "tokenizer.model",
            "tokenize/a": w / "tokens/a/shard-00000-00000.stats.json",
            "tokenize/b": w / "tokens/b/shard-00000-00000.stats.json",
            "merge/a": w / "merge/a/unit-00000.json", "merge/b": w / "merge/b/unit-00000.json",
            "manifest": build / "manifest.json"}


def _stamp(build: Path) -> dict[str, int]:
    return {k: p.stat().st_mtime_ns for k, p in _files(build).items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuildConfig]:
    root = tmp_path_factory.mktemp("rebuild")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) + "." for _ in range(40)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = BuildConfig(output_dir=str(root / "out"), workers=2, shard_docs=16,
                      sources=[SourceConfig(name=n, path=str(root / f"{n}.jsonl"), filters=["length"])
                               for n in ("a", "b")],
                      tokenizer=TokenizerConfig(vocab_size=300, sample_chars=50_000))
    run_build(cfg)
    return root, cfg


def _edit_and_rebuild(cfg: BuildConfig, edited: BuildConfig) -> tuple[set[str], dict]:
    out = Path(cfg.output_dir)
    before = _stamp(out)
    manifest = run_build(edited)
    after = _stamp(out)
    return {k for k in before if before[k] != after[k]}, manifest


def test_three_config_edits_redo_what_the_dependency_table_says(base) -> None:  # type: ignore[no-untyped-def]
    root, cfg = base
    # A cosmetic key: nothing is redone, the manifest is the same file.
    cosmetic = dataclasses.replace(cfg, workers=1)
    redone, manifest = _edit_and_rebuild(cfg, cosmetic)
    assert redone == set()
    # sentencepiece's thread count changes its model: a tokenizer setting, stamped (`workers` is not).
    threads = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, threads=1))
    changed = {k for k, v in stage_keys(threads).items() if stage_keys(cfg)[k] != v}
    assert changed == {"tokenizer", "tokenize/a", "tokenize/b", "merge/a", "merge/b", "manifest"}

    # The tokenizer only: the tokenizer and every source's tokenize step (and the manifest).
    tok = dataclasses.replace(cosmetic, tokenizer=TokenizerConfig(vocab_size=320, sample_chars=50_000))
    redone, manifest = _edit_and_rebuild(cfg, tok)
    assert redone == {"tokenizer", "tokenize/a", "tokenize/b", "merge/a", "merge/b", "manifest"}
    fresh = run_build(dataclasses.replace(tok, output_dir=str(root / "fresh_tok")))
    assert manifest["fingerprint"] == fresh["fingerprint"] and manifest["sources"] == fresh["sources"]
    assert manifest["tokenizer"]["vocab_size"] == 320

    # One source's filters: that source's ingest and signatures, both dedup stages, the sampled tokenizer and
    # every source's tokenize step — never the other source's ingest or signatures.
    a, b = tok.sources
    filt = dataclasses.replace(tok, sources=[dataclasses.replace(a, filters=["length", "docs"]), b])
    redone, manifest = _edit_and_rebuild(cfg, filt)
    assert redone == {"ingest/a", "minhash/a", "exact", "near", "tokenizer", "tokenize/a", "tokenize/b", "merge/a",
                      "merge/b", "manifest"}
    assert manifest["sources"]["a"]["documents"]["filtered"].get("docs.word_count", 0) > 0
    fresh = run_build(dataclasses.replace(filt, output_dir=str(root / "fresh_filt")))
    assert manifest["fingerprint"] == fresh["fingerprint"] and manifest["sources"] == fresh["sources"]
    assert json.loads((root / "out/manifest.json").read_text())["config"]["sources"][0]["filters"] == \
        ["length", "docs"]  # the manifest records the config its data was built with

    # merge_bytes lays out the merge stage's files, no byte of the data: the merges are redone, in more units.
    data = {p.name: p.read_bytes() for p in (root / "out").iterdir() if p.suffix in (".bin", ".idx", ".npy")}
    redone, manifest = _edit_and_rebuild(cfg, dataclasses.replace(filt, merge_bytes=64))
    assert redone == {"merge/a", "merge/b", "manifest"} and manifest["fingerprint"] == fresh["fingerprint"]
    assert data == {p.name: p.read_bytes() for p in (root / "out").iterdir() if p.name in data} and len(data) == 6
    assert len(list((root / "out/work/merge/a").glob("unit-*.json"))) >= 2


def test_sources_and_the_tokenizer_file_are_checked_before_any_stage(base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, cfg = base
    bad_path = dataclasses.replace(cfg, output_dir=str(tmp_path / "o1"), sources=[
        cfg.sources[0], dataclasses.replace(cfg.sources[1], path=str(root / "missing.jsonl"))])
    with pytest.raises(ConfigError, match=r"sources\[b\].*missing\.jsonl.*does not exist"):
        run_build(bad_path)
    assert not (tmp_path / "o1").exists()  # source a was not ingested first
    (tmp_path / "tok.json").write_text("{}")
    bad_tok = dataclasses.replace(cfg, output_dir=str(tmp_path / "o2"),
                                  tokenizer=TokenizerConfig(model=str(tmp_path / "tok.json")))
    with pytest.raises(ConfigError, match="does not load as a tokenizer"):
        run_build(bad_tok)
    assert not (tmp_path / "o2").exists()
