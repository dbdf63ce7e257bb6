"""prepare_data on the stdlib corpus and synthetic data: contents, cache, builder/non-builder, held-out split."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.build.cache import build_once
from data_pipeline.config import DataConfig, MixturePhase
from data_pipeline.indexed import IndexedTokens
from data_pipeline.read.packing import PackedSource
from data_pipeline.read.prepare import prepare_data, tokenizer_path
from data_pipeline.tokenizer import Tokenizer
from framework.base.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[2]


def test_tokenizer_path_reads_only_the_manifest(stdlib_build, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The tokenizer a checkpoint's export finds is the one prepare_data hands the trainer, for a stdlib cache
    entry and for the same build named by build_dir; a build without a manifest is refused, never built."""
    want = Path(str(prepare_data(stdlib_build.cfg).tokenizer_path))
    assert want.is_file() and tokenizer_path(stdlib_build.cfg) == want
    assert tokenizer_path(DataConfig(kind="build", build_dir=str(stdlib_build.build_dir))) == want
    assert tokenizer_path(DataConfig(kind="synthetic")) is None
    with pytest.raises(DataError, match="not a finished data build"):
        tokenizer_path(replace(stdlib_build.cfg, cache_dir=str(tmp_path / "empty")))
    assert not (tmp_path / "empty").exists()


def test_stdlib_build_contents_and_accounting(stdlib_build) -> None:  # type: ignore[no-untyped-def]
    prepared = prepare_data(stdlib_build.cfg)
    manifest = json.loads((stdlib_build.build_dir / "manifest.json").read_text())
    assert set(manifest["sources"]) == {"code", "prose", "tests"}
    for name, src in manifest["sources"].items():
        d = src["documents"]
        assert d["in"] == d["kept"] + sum(d["filtered"].values()) + d["exact_duplicate"] + d["near_duplicate"] + \
            sum(d["malformed"].values())
        assert d["kept"] == len(IndexedTokens(stdlib_build.build_dir / name)) > 100
    assert manifest["sources"]["code"]["documents"]["exact_duplicate"] >= 0
    assert prepared.vocab_size == 4096 and prepared.eos_id == 2 and prepared.tokenizer_path
    tokens = IndexedTokens(stdlib_build.build_dir / "code")
    assert all(tokens[i][-1] == prepared.eos_id for i in range(0, len(tokens), 50))  # EOS ends every document
    for j in (0, 1, 12345, len(prepared.train) - 1):
        s = prepared.train[j]
        assert s.dtype == np.int64 and s.shape == (65,) and 0 <= s.min() and s.max() < 4096
    assert set(prepared.val) == {"code", "prose", "tests"} and all(len(v) > 0 for v in prepared.val.values())
    text = Tokenizer(prepared.tokenizer_path).decode(prepared.train[0].tolist())
    assert len(text) > 100  # real text, ~3 characters per token


def test_rerun_hits_the_cache_fast_without_importing_megatron(stdlib_build) -> None:  # type: ignore[no-untyped-def]
    code = (
        "import sys, time\n"
        "from data_pipeline.config import DataConfig\nfrom data_pipeline.read.prepare import prepare_data\n"
        "t = time.perf_counter()\n"
        f"p = prepare_data(DataConfig(kind='stdlib', cache_dir={stdlib_build.cfg.cache_dir!r}, seq_len=64))\n"
        "p.train[0]; print(time.perf_counter() - t, p.fingerprint)\n"
        "assert not any(m.startswith('megatron') for m in sys.modules), 'training ranks must not import megatron'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    seconds, fingerprint = out.stdout.split()
    assert float(seconds) < 2.0
    assert fingerprint == prepare_data(stdlib_build.cfg).fingerprint


def test_held_out_documents_do_not_depend_on_the_mixture(stdlib_build) -> None:  # type: ignore[no-untyped-def]
    a = prepare_data(stdlib_build.cfg)
    b = prepare_data(replace(stdlib_build.cfg, weights={"code": 1.0}, seed=99))
    for name in a.val:
        va, vb = a.val[name], b.val[name]
        assert isinstance(va, PackedSource) and isinstance(vb, PackedSource)
        assert np.array_equal(va.doc_ids, vb.doc_ids)
        assert not set(va.doc_ids.tolist()) & set(a.train.sources[a.train.names.index(name)].doc_ids.tolist())
    assert a.fingerprint != b.fingerprint
    src = [a.train.locate(j)[0] for j in range(3000)]
    counts = np.bincount(src, minlength=3) / 3000  # names sorted: code, prose, tests
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=1 / 1000)


def test_unshuffled_packing_reconstructs_the_token_stream(stdlib_build) -> None:  # type: ignore[no-untyped-def]
    tokens = IndexedTokens(stdlib_build.build_dir / "prose")
    ids = np.arange(0, 40)
    src = PackedSource(tokens, ids, seq_len=16, seed=0, name="prose", shuffle=False)
    stream = np.concatenate([tokens[int(i)] for i in ids]).astype(np.int64)
    assert len(src) == (len(stream) - 1) // 16
    for k in range(len(src)):
        assert np.array_equal(src[k], stream[k * 16:k * 16 + 17])  # one token of overlap: every label once


def test_schedule_needs_the_global_batch_size(stdlib_build) -> None:  # type: ignore[no-untyped-def]
    cfg = replace(stdlib_build.cfg, schedule=[MixturePhase(start_step=10, weights={"prose": 1.0})])
    with pytest.raises(ConfigError, match="global_batch_size"):
        prepare_data(cfg)
    p = prepare_data(cfg, global_batch_size=8)
    assert all(p.train.locate(j)[0] == 1 for j in range(80, 200))


def test_non_builders_wait_for_the_builders_marker(tmp_path: Path) -> None:
    final = tmp_path / "build"
    order: list[str] = []

    def slow_build(tmp: Path) -> None:
        time.sleep(0.5)
        (tmp / "manifest.json").write_text("{}")
        order.append("built")

    def waiter() -> None:
        build_once(final, slow_build, is_builder=False, timeout_s=30)
        order.append("waited")

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    build_once(final, slow_build, is_builder=True, timeout_s=30)
    t.join()
    assert order == ["built", "waited"] and (final / "manifest.json").is_file()
    build_once(final, slow_build, is_builder=True, timeout_s=30)  # already done: not rebuilt
    assert order == ["built", "waited"]
    with pytest.raises(DataError, match="is_builder=True"):
        build_once(tmp_path / "never", slow_build, is_builder=False, timeout_s=0.2)


def test_synthetic_kind() -> None:
    p = prepare_data(DataConfig(kind="synthetic", vocab_size=64, seq_len=16))
    assert p.vocab_size == 64 and p.tokenizer_path is None and p.train[5].shape == (17,)
    assert set(p.val) == {"synthetic"} and not np.array_equal(p.val["synthetic"][0], p.train[0])


def _read(args: tuple[object, list[int]]) -> list[list[int]]:
    samples, idx = args
    return [samples[i].tolist() for i in idx]  # type: ignore[index]


def test_samples_do_not_depend_on_loader_workers(stdlib_build) -> None:  # type: ignore[no-untyped-def]
    from multiprocessing import get_context

    train = prepare_data(stdlib_build.cfg).train
    idx = list(range(0, 4000, 37))
    reference = _read((train, idx))
    for workers in (2, 3):
        parts = [idx[w::workers] for w in range(workers)]  # interleaved, like DataLoader workers
        with get_context("fork").Pool(workers) as pool:
            got = pool.map(_read, [(prepare_data(stdlib_build.cfg).train, p) for p in parts])
        merged = [None] * len(idx)
        for w, rows in enumerate(got):
            merged[w::workers] = rows
        assert merged == reference
