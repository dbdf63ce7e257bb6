"""Fault probes: one bad record or file never aborts a build; each is counted under a reason, a compressed
file that ends early keeps (and reports) the records read before the break, and the accounting holds."""

from __future__ import annotations

import bz2
import gzip
import json
import os
import random
import re
from pathlib import Path

import pytest
import zstandard

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.dedup import DedupConfig
from data_pipeline.build.ingest import read_records
from data_pipeline.build.run import run_build
from data_pipeline.build.shard_files import read_shard_texts, read_shard_where

N = 3000


def _lines(tag: str, n: int) -> bytes:
    return b"".join(json.dumps({"text": f"document {i} of {tag}: some words to read"}).encode() + b"\n"
                    for i in range(n))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("faults")
    d = root / "jsonl"
    d.mkdir()
    (d / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + _lines("bom", 5))
    (d / "cat.jsonl").write_bytes(b"\xef\xbb\xbf" + _lines("cat1", 2) + b"\xef\xbb\xbf" + _lines("cat2", 2))  # cat a b
    (d / "odd.jsonl").write_bytes(_lines("odd", 3) + b'{"text": "big", "n": ' + b"7" * 5000 + b"}\n" +
                                  b"[" * 100_000 + b"]" * 100_000 + b"\n")
    gz = gzip.compress(_lines("gz", N))
    (d / "truncated.jsonl.gz").write_bytes(gz[:len(gz) // 2])
    (d / "corrupt.jsonl.gz").write_bytes(gz[:10] + bytes(range(256)) * 4)
    zst = zstandard.ZstdCompressor().compress(_lines("zst", 8 * N))  # zstd decodes whole 128 KiB blocks
    (d / "truncated.jsonl.zst").write_bytes(zst[:len(zst) // 2])
    (d / "corrupt.jsonl.zst").write_bytes(zst[:6] + bytes(range(256)) * 4)
    (d / "whole.jsonl.bz2").write_bytes(bz2.compress(_lines("bz2", 4)))
    os.symlink("/proc/self/mem", d / "unreadable.jsonl")  # opens, but every read fails (EIO), even as root
    with pytest.raises(OSError):
        (d / "unreadable.jsonl").read_bytes()
    tree = root / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("a plain document")
    (tree / "c.txt").write_bytes("café in latin-1".encode("latin-1"))
    (tree / "blob.c").write_bytes(random.Random(7).randbytes(4096))  # a binary kept under a source's name
    tree_gz = gzip.compress(_lines("tree", N))
    (tree / "b.txt.gz").write_bytes(tree_gz[:len(tree_gz) // 2])
    cfg = BuildConfig(output_dir=str(root / "out"), workers=2, shard_docs=1000, dedup=DedupConfig(near=False),
                      sources=[SourceConfig(name="jsonl", path=str(d), profile="minimal"),
                               SourceConfig(name="tree", path=str(tree), profile="minimal",
                                            encoding_fallback="latin-1")],
                      tokenizer=TokenizerConfig(vocab_size=300, sample_chars=20_000))
    return root, run_build(cfg)


def test_every_bad_record_and_file_is_counted_and_the_build_goes_on(faulty) -> None:  # type: ignore[no-untyped-def]
    root, manifest = faulty
    d = manifest["sources"]["jsonl"]["documents"]
    assert d["malformed"] == {"bad_json": 1, "json_too_deep": 1, "truncated_file": 2, "corrupt_file": 2,
                              "unreadable_file": 1}, d
    assert d["in"] == d["kept"] + sum(d["filtered"].values()) + d["exact_duplicate"] + d["near_duplicate"] + \
        sum(d["malformed"].values())
    kept_from: dict[str, int] = {}
    for shard in (root / "out/work/ingest/jsonl").glob("shard-*.jsonl"):
        for w in read_shard_where(shard):
            name = Path(w.rsplit(":", 1)[0]).name
            kept_from[name] = kept_from.get(name, 0) + 1
    assert kept_from["bom.jsonl"] == 5 and kept_from["cat.jsonl"] == 4
    assert kept_from["odd.jsonl"] == 3 and kept_from["whole.jsonl.bz2"] == 4
    rejects = [json.loads(x) for x in (root / "out/work/ingest/jsonl/rejects.jsonl").read_text().splitlines()]
    for name in ("truncated.jsonl.gz", "truncated.jsonl.zst"):
        (rej,) = [r for r in rejects if r["reason"] == "truncated_file" and r["where"].endswith(name)]
        read = int(re.search(r"(\d+) records read", rej["raw"]).group(1))
        assert 0 < read < 8 * N and kept_from[name] == read, (name, read, kept_from.get(name))
    t = manifest["sources"]["tree"]["documents"]
    # The random bytes decode under latin-1 (and 68% of them are isalnum() there): the binary rule, run before any
    # profile's filters (this source's profile is minimal), drops them; the real latin-1 text stays.
    assert t["in"] == 4 and t["kept"] == 2 and t["malformed"] == {"truncated_file": 1}
    assert t["filtered"] == {"binary.nul_bytes": 1}, t
    assert manifest["sources"]["tree"]["notes"] == {"encoding_fallback.latin-1": 2}
    texts = [x for shard in (root / "out/work/ingest/tree").glob("shard-*.jsonl") for x in read_shard_texts(shard)]
    assert "café in latin-1" in texts


def test_a_bom_is_stripped_from_the_first_record() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "x.jsonl"
        p.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
        assert [r.text for r in read_records(p)] == ["first", "second"]
