"""The build pipeline end to end on deliberately bad records in every format: accounting, rejects, resume."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig, load_build_config
from data_pipeline.build.filters import FiltersConfig, LengthFilter
from data_pipeline.build.run import run_build
from data_pipeline.config import DataConfig
from data_pipeline.indexed import IndexedTokens
from data_pipeline.read.prepare import prepare_data
from data_pipeline.tokenizer import Tokenizer
from framework.base.errors import ConfigError, DataError

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega the of and to with have that be").split()


def _doc(rng: np.random.Generator, n: int = 80) -> str:
    return " ".join(rng.choice(WORDS, size=n)) + "."


def _write_sources(root: Path) -> tuple[list[SourceConfig], dict[str, dict[str, int]]]:
    """Every format, each with bad records; returns the sources and the malformed/filtered counts expected."""
    rng = np.random.default_rng(0)
    good = [_doc(rng) for _ in range(60)]
    lines = [json.dumps({"text": t}).encode() for t in good[:20]]
    lines += [b'{"text": "unterminated', b'{"body": "no text field"}', b'{"text": 42}', b'[1, 2, 3]',
              b'{"text": "bad \xff\xfe utf8"}', b'{"text": "lone \\udc80 surrogate"}', b'{"text": "   "}',
              json.dumps({"text": "x " * 5_000_000}).encode(),  # a 10 MB document
              json.dumps({"text": good[0]}).encode()]  # an exact duplicate within the source
    raw = b"\n".join(lines) + b"\n"
    (root / "a.jsonl").write_bytes(raw)
    with gzip.open(root / "b.jsonl.gz", "wb") as f:
        f.write(raw)
    import zstandard

    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    jsonl_expect = {"bad_json": 1, "missing_field": 1, "non_string_field": 1, "not_an_object": 1,
                    "invalid_utf8": 2}
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": [*good[20:40], None, good[20]]}), root / "d.parquet", row_group_size=7)
    tree = root / "tree"
    (tree / "sub").mkdir(parents=True)
    for i, t in enumerate(good[40:50]):
        (tree / "sub" / f"{i}.txt").write_text(t)
    (tree / "bad.txt").write_bytes(b"\xc3\x28 not utf-8")
    import datasets

    datasets.Dataset.from_dict({"text": [*good[50:60], good[1]]}).save_to_disk(str(root / "hf"))
    # Local files read through `datasets.load_dataset("json", ...)`; a row without the field reads as None.
    (root / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"text": _doc(rng)}, {"other": "x"}]))
    sources = [
        SourceConfig(name="plain", path=str(root / "a.jsonl"), profile="minimal", priority=1),
        SourceConfig(name="gz", path=str(root / "b.jsonl.gz"), profile="minimal"),
        SourceConfig(name="zst", path=str(root / "c.jsonl.zst"), profile="minimal"),
        SourceConfig(name="pq", path=str(root / "d.parquet"), text_field="content", profile="minimal"),
        SourceConfig(name="tree", path=str(tree), glob="*.txt", profile="minimal"),
        SourceConfig(name="hf", path=str(root / "hf"), profile="minimal", priority=2),
        SourceConfig(name="hfjson", path=str(root / "e.jsonl"), hf_builder="json", profile="minimal"),
    ]
    expect = {name: {"malformed": jsonl_expect, "in": 29} for name in ("plain", "gz", "zst")}
    expect["pq"] = {"malformed": {"missing_field": 1}, "in": 22}
    expect["tree"] = {"malformed": {"invalid_utf8": 1}, "in": 11}
    expect["hf"] = {"malformed": {}, "in": 11}
    expect["hfjson"] = {"malformed": {"missing_field": 1}, "in": 2}
    return sources, expect


def _config(root: Path, sources: list[SourceConfig], out: str = "out") -> BuildConfig:
    return BuildConfig(output_dir=str(root / out), sources=sources, shard_docs=8, workers=2,
                       filters=FiltersConfig(length=LengthFilter(min_chars=1, max_chars=1_000_000)),
                       tokenizer=TokenizerConfig(vocab_size=320, sample_chars=200_000))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[SourceConfig], dict, dict]:
    """One straight build of the bad-records fixture, shared by the tests of this module."""
    root = tmp_path_factory.mktemp("sources")
    sources, expect = _write_sources(root)
    return root, sources, expect, run_build(_config(root, sources))


def test_bad_records_everywhere_are_counted_and_the_invariant_holds(built) -> None:  # type: ignore[no-untyped-def]
    tmp_path, _, expect, manifest = built
    for name, want in expect.items():
        d = manifest["sources"][name]["documents"]
        assert d["in"] == want["in"] and d["malformed"] == want["malformed"], (name, d)
        assert d["in"] == d["kept"] + sum(d["filtered"].values()) + d["exact_duplicate"] + d["near_duplicate"] + \
            sum(d["malformed"].values())
        assert d["kept"] == len(IndexedTokens(tmp_path / "out" / name))
    plain = manifest["sources"]["plain"]["documents"]
    assert plain["filtered"] == {"empty": 1, "length.too_long": 1}
    # 'plain' (priority 1) keeps good[0..19] but good[1], which hf (priority 2) keeps; gz and zst repeat all 21.
    assert plain["exact_duplicate"] == 2 and plain["kept"] == 19
    assert manifest["sources"]["gz"]["documents"]["exact_duplicate"] == 21
    assert manifest["sources"]["hf"]["documents"]["kept"] == 11
    assert manifest["sources"]["pq"]["documents"]["exact_duplicate"] == 1
    rejects = [json.loads(x) for x in (tmp_path / "out/work/ingest/plain/rejects.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == sorted(k for k, v in expect["plain"]["malformed"].items()
                                                          for _ in range(v))
    tok = Tokenizer(tmp_path / "out" / "tokenizer.model")
    docs = IndexedTokens(tmp_path / "out" / "tree")
    assert docs[0][-1] == tok.eos_id and tok.decode(docs[0][:-1].tolist()).endswith(".")
    assert manifest["tokenizer"]["vocab_size"] == tok.vocab_size and len(manifest["fingerprint"]) == 64


def test_interrupted_build_resumes_without_rewriting(built) -> None:  # type: ignore[no-untyped-def]
    tmp_path, sources, _, straight = built
    cfg = _config(tmp_path, sources, "resumed")
    assert run_build(cfg, stages=("ingest", "exact", "minhash")) == {}
    work = tmp_path / "resumed" / "work"
    shards = sorted((work / "ingest").rglob("shard-*.jsonl"))
    stamps = {p: p.stat().st_mtime_ns for p in shards}
    sigs = sorted((work / "bands").rglob("*.keys.npy"))
    sigs[0].unlink()  # as if killed while writing this one (temporary files are never read)
    (sigs[0].parent / (sigs[0].name + ".tmp-1.npy")).write_bytes(b"partial garbage")
    resumed = run_build(cfg)
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # finished work was not redone
    assert sigs[0].is_file()
    assert resumed["fingerprint"] == straight["fingerprint"]
    assert resumed["sources"] == straight["sources"]
    assert run_build(cfg) == resumed  # a finished build is a no-op


def test_prepare_reads_a_build_and_yaml_configs_load(built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root = built[0]
    data = prepare_data(DataConfig(kind="build", build_dir=str(root / "out"), seq_len=16,
                                   weights={"plain": 0.5, "pq": 0.25, "tree": 0.25}, val_fraction=0.2))
    assert data.vocab_size >= 256 and data.train[3].shape == (17,)
    with pytest.raises(DataError, match="known sources"):
        prepare_data(DataConfig(kind="build", build_dir=str(root / "out"), weights={"nope": 1.0}))
    for path in sorted(Path(__file__).resolve().parents[2].glob("configs/data/*.yaml")):
        assert load_build_config(path).sources
    (tmp_path / "bad.yaml").write_text("output_dir: x\nsources: [{name: a, path: b, profil: web}]\n")
    with pytest.raises(ConfigError, match=r"sources\[0\]\.profil.*profile"):
        load_build_config(tmp_path / "bad.yaml")


def test_build_killed_hard_then_rerun_matches_a_straight_build(built) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL the building process at its n-th atomic write (mid-ingest, then later), rerun, compare."""
    import os
    import subprocess
    import sys

    import yaml

    from framework.base.yaml_config import to_dict

    root, sources, _, straight = built
    for n in (3, 9):
        cfg = _config(root, sources, f"killed{n}")
        cfg_file = root / f"killed{n}.yaml"
        cfg_file.write_text(yaml.safe_dump(to_dict(cfg)))
        code = (
            "import os, signal\nimport data_pipeline.build.shard_files as st\nimport data_pipeline.build.run as b\n"
            "main, calls, orig = os.getpid(), [0], st.save_npy_atomic\n"
            "def killer(path, arr):\n"
            "    if os.getpid() == main:\n"
            "        calls[0] += 1\n"
            f"        if calls[0] == {n}: os.kill(main, signal.SIGKILL)\n"
            "    orig(path, arr)\n"
            "st.save_npy_atomic = killer\n"
            "from data_pipeline.build.config import load_build_config\n"
            f"b.run_build(load_build_config({str(cfg_file)!r}))\n")
        repo = Path(__file__).resolve().parents[2]
        proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(repo)})
        assert proc.returncode == -9, proc.stderr[-2000:]
        assert not (root / f"killed{n}" / "manifest.json").exists()
        resumed = run_build(cfg)
        assert resumed["fingerprint"] == straight["fingerprint"] and resumed["sources"] == straight["sources"]


def test_training_start_logs_the_mixture_and_warns_on_upsampling(built, capsys) -> None:  # type: ignore[no-untyped-def]
    root = built[0]
    prepare_data(DataConfig(kind="build", build_dir=str(root / "out"), seq_len=16, num_samples=2000,
                            weights={"plain": 0.5, "pq": 0.5}, val_fraction=0.2, warn_epochs=4.0))
    err = capsys.readouterr().err
    plain = next(line for line in err.splitlines() if "mixture plain:" in line)
    assert "1,000 of 2,000 samples per pass" in plain and "epochs of its" in plain
    assert "WARNING: source plain is read" in err and "data.warn_epochs=4.0" in err
    assert "mixture tree: 0 of 2,000" in err
