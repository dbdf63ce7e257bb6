"""Our numpy-memmap reader against megatron-core's IndexedDataset, both directions, token for token."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import IndexedTokens, IndexedWriter
from framework.errors import DataError


def _megatron() -> tuple[type, type]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    return IndexedDataset, IndexedDatasetBuilder


def _docs(vocab: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(0, 300))) for _ in range(n)]  # includes empty docs


def test_megatron_reads_our_files_token_for_token(tmp_path: Path) -> None:
    IndexedDataset, _ = _megatron()
    for vocab in (4096, 100_000):  # uint16 and int32 token files
        docs = _docs(vocab, 200, vocab)
        writer = IndexedWriter(tmp_path / f"ours{vocab}", vocab)
        for d in docs:
            writer.add(d)
        writer.finalize()
        theirs = IndexedDataset(str(tmp_path / f"ours{vocab}"))
        ours = IndexedTokens(tmp_path / f"ours{vocab}")
        assert len(theirs) == len(ours) == len(docs)
        assert np.array_equal(theirs.document_indices, ours.document_indices)
        for i, d in enumerate(docs):
            assert np.array_equal(theirs[i], d) and np.array_equal(ours[i], d)
            if len(d) > 5:
                assert np.array_equal(theirs.get(i, offset=2, length=3), ours.get(i, offset=2, length=3))


def test_we_read_files_megatrons_builder_wrote(tmp_path: Path) -> None:
    _, Builder = _megatron()
    for dtype in (np.uint16, np.int32, np.int64):
        docs = _docs(30_000, 150, 1)
        prefix = str(tmp_path / f"theirs_{np.dtype(dtype).name}")
        builder = Builder(prefix + ".bin", dtype=dtype)
        for d in docs:
            # Two sequences per document, as megatron's preprocess_data does for sentence splits.
            half = len(d) // 2
            builder.add_document(d, [half, len(d) - half])
        builder.finalize(prefix + ".idx")
        ours = IndexedTokens(prefix)
        assert ours.dtype == np.dtype(dtype) and len(ours) == 2 * len(docs)
        assert np.array_equal(ours.document_indices, np.arange(0, 2 * len(docs) + 1, 2))
        got = [np.concatenate([ours[2 * i], ours[2 * i + 1]]) for i in range(len(docs))]
        assert all(np.array_equal(g, d) for g, d in zip(got, docs, strict=True))


def test_stdlib_build_matches_megatron(stdlib_build) -> None:  # type: ignore[no-untyped-def]
    IndexedDataset, _ = _megatron()
    for domain in ("code", "prose", "tests"):
        prefix = str(stdlib_build.build_dir / domain)
        theirs, ours = IndexedDataset(prefix), IndexedTokens(prefix)
        assert len(theirs) == len(ours) > 0
        assert np.array_equal(theirs.sequence_lengths, ours.sequence_lengths)
        for i in range(0, len(ours), max(1, len(ours) // 300)):
            assert np.array_equal(theirs[i], ours[i])


def test_truncated_or_foreign_files_are_refused(tmp_path: Path) -> None:
    writer = IndexedWriter(tmp_path / "x", 4096)
    writer.add(np.arange(10))
    writer.finalize()
    with open(tmp_path / "x.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="rebuild"):
        IndexedTokens(tmp_path / "x")
    (tmp_path / "y.idx").write_bytes(b"not an index at all, really not" * 2)
    (tmp_path / "y.bin").write_bytes(b"")
    with pytest.raises(DataError, match="header"):
        IndexedTokens(tmp_path / "y")
    with pytest.raises(DataError, match="missing"):
        IndexedTokens(tmp_path / "z")
