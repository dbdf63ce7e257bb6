"""Our numpy-memmap reader against megatron-core's IndexedDataset, both directions, token for token; our writer
(the tokenize stage's) against megatron-core's IndexedDatasetBuilder and our concatenation of many .bin/.idx pairs
(the merge stage's) against megatron-core's add_index, byte for byte."""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import IndexedTokens, IndexedWriter, open_sized, plan_concat, write_parts
from framework.base.errors import DataError


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


def test_our_writer_is_megatrons_builder_byte_for_byte(tmp_path: Path) -> None:
    """IndexedWriter against megatron-core's IndexedDatasetBuilder fed as the tokenize stage fed it before
    (`add_item(torch.from_numpy(int64 tokens))` + `end_document()` per document, then `finalize`): the same .bin and
    .idx bytes for random document sets with empty documents among them, only empty documents, one token, and no
    documents at all, in uint16 and int32; no temporary file left; megatron-core's reader reads ours."""
    import torch

    IndexedDataset, Builder = _megatron()
    rng = np.random.default_rng(11)
    for vocab, dtype in ((4096, np.uint16), (100_000, np.int32)):
        sets = []
        for seed in range(4):
            docs = _docs(vocab, int(rng.integers(1, 400)), 100 * seed + vocab)
            for at in rng.integers(0, len(docs) + 1, size=3):
                docs.insert(int(at), np.zeros(0, dtype=np.int64))
            sets.append(docs)
        sets += [[], [np.zeros(0, dtype=np.int64)] * 3, [np.array([vocab - 1])]]
        for k, docs in enumerate(sets):
            ref, ours = tmp_path / f"ref{vocab}-{k}", tmp_path / f"ours{vocab}-{k}"
            builder = Builder(f"{ref}.bin", dtype=dtype)
            writer = IndexedWriter(ours, vocab)
            for i, d in enumerate(docs):
                builder.add_item(torch.from_numpy(np.asarray(d, dtype=np.int64)))
                builder.end_document()
                writer.add(d.tolist() if i % 2 else d)  # lists of ints as well as int64 arrays
            builder.finalize(f"{ref}.idx")
            writer.finalize()
            for ext in (".bin", ".idx"):
                assert Path(f"{ours}{ext}").read_bytes() == Path(f"{ref}{ext}").read_bytes(), (vocab, k, ext)
            assert writer.num_docs == len(docs) and writer.num_tokens == sum(len(d) for d in docs)
            if writer.num_tokens:  # megatron-core cannot map an empty .bin
                theirs = IndexedDataset(str(ours))
                assert len(theirs) == len(docs) and np.array_equal(theirs.document_indices, np.arange(len(docs) + 1))
                assert all(np.array_equal(theirs[i], d) for i, d in enumerate(docs))
    assert not list(tmp_path.glob("*.tmp*"))


def test_writer_imports_neither_megatron_nor_torch() -> None:
    """The tokenize stage's writer runs without megatron-core (~4.5 s, ~150 MB per process) or torch."""
    import subprocess
    import sys

    code = ("import sys, tempfile, numpy as np; from data_pipeline.indexed import IndexedWriter\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    w = IndexedWriter(d + '/x', 4096); w.add(np.arange(5)); w.finalize()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "[]", out.stdout


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


def test_concatenation_in_any_units_is_megatrons_add_index_byte_for_byte(tmp_path: Path) -> None:
    """Parts of one and two sequences per document, empty documents and an empty part, merged by megatron-core
    (add_index + finalize) and by us — in one go, and as units of parts written in shuffled order through
    separately opened descriptors, as array tasks do: the same bytes, which megatron-core reads back."""
    import torch

    IndexedDataset, Builder = _megatron()
    rng = np.random.default_rng(3)
    for vocab, dtype in ((4096, np.uint16), (100_000, np.int32)):
        prefixes = []
        for k in range(7):
            prefix = str(tmp_path / f"part{vocab}-{k}")
            builder = Builder(prefix + ".bin", dtype=dtype)
            for d in _docs(vocab, 0 if k == 2 else int(rng.integers(1, 40)), 10 * k + vocab):
                if k % 3 == 1:  # two sequences per document
                    builder.add_document(d, [len(d) // 2, len(d) - len(d) // 2])
                else:
                    builder.add_item(torch.from_numpy(d))
                    builder.end_document()
            builder.finalize(prefix + ".idx")
            prefixes.append(prefix)
        for parts in (prefixes, prefixes[2:3], []):
            ref = tmp_path / f"ref{vocab}-{len(parts)}"
            builder = Builder(f"{ref}.bin", dtype=dtype)
            for p in parts:
                builder.add_index(p)
            builder.finalize(f"{ref}.idx")
            plan = plan_concat(parts, vocab)
            cuts = sorted({0, len(parts), *rng.integers(0, len(parts) + 1, size=3).tolist()})
            units = list(itertools.pairwise(cuts)) or [(0, 0)]
            for name, order in (("one", [(0, len(parts))]), ("units", [units[i] for i in rng.permutation(len(units))])):
                ours = tmp_path / f"{name}{vocab}-{len(parts)}"
                for lo, hi in order:
                    bin_fd = open_sized(Path(f"{ours}.bin"), plan.bin_bytes)
                    idx_fd = open_sized(Path(f"{ours}.idx"), plan.idx_bytes)
                    write_parts(plan, lo, hi, bin_fd, idx_fd)
                    os.close(bin_fd)
                    os.close(idx_fd)
                for ext in (".bin", ".idx"):
                    assert Path(f"{ours}{ext}").read_bytes() == Path(f"{ref}{ext}").read_bytes(), (vocab, name, ext)
            if plan.bin_bytes:  # megatron-core cannot map an empty .bin (nor can its own merge of empty parts)
                theirs = IndexedDataset(str(ours))
                assert len(theirs) == plan.n_sequences and len(theirs.document_indices) == plan.n_documents
        assert len(prefixes) == 7 and plan_concat(prefixes, vocab).n_sequences > 100


def test_concatenation_refuses_parts_that_do_not_fit(tmp_path: Path) -> None:
    writer = IndexedWriter(tmp_path / "a", 4096)
    writer.add(np.arange(10))
    writer.finalize()
    with pytest.raises(DataError, match=r"holds uint16 tokens, but a vocabulary of 100000 is written as int32"):
        plan_concat([tmp_path / "a"], 100_000)
    with open(tmp_path / "a.bin", "ab") as f:
        f.write(b"\0\0")
    plan = plan_concat([tmp_path / "a"], 4096)
    fds = [open_sized(tmp_path / "o.bin", plan.bin_bytes), open_sized(tmp_path / "o.idx", plan.idx_bytes)]
    with pytest.raises(DataError, match=r"a\.bin holds 22 bytes but its index describes 20"):
        write_parts(plan, 0, 1, *fds)
    with open(tmp_path / "a.idx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match=r"do not describe its 63 bytes"):
        plan_concat([tmp_path / "a"], 4096)
