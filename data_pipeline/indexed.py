"""Megatron indexed datasets (.bin/.idx): our numpy-memmap reader, and writing through megatron-core.

The format (megatron-core 0.16.1 `indexed_dataset.py`), all little-endian:
    .idx = b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 n_sequences | u64 n_documents
           | i32 lengths[n_sequences] | i64 byte pointers[n_sequences] | i64 document_indices[n_documents]
           | (i8 modes[n_sequences] when multimodal)
    .bin = the tokens of every sequence, back to back, in the dtype of the code.
Tessera writes one sequence per document (document_indices = 0..n), each ending with EOS.

Training ranks read with `IndexedTokens` (numpy only): importing megatron-core costs ~4.5 s per process
(docs/DATA.md), so it is imported lazily and only by `IndexedWriter` (offline builds) and tests.
"""

from __future__ import annotations

import gc
import struct
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from framework.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
# Megatron's DType enum codes.
DTYPE_CODES: dict[int, type[np.number[Any]]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}


def token_dtype(vocab_size: int) -> type[np.number[Any]]:
    """The narrowest dtype Megatron uses for a vocabulary (`DType.optimal_dtype`)."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedTokens:
    """Read-only view of a Megatron .bin/.idx pair through numpy memmaps.

    Args:
        prefix: Path without extension; `prefix.idx` and `prefix.bin` must exist.
        multimodal: Whether the index carries per-sequence modes (never for Tessera's text builds).
    """

    def __init__(self, prefix: str | Path, multimodal: bool = False) -> None:
        self.prefix = str(prefix)
        idx_path, bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        if not idx_path.is_file() or not bin_path.is_file():
            missing = idx_path.name if not idx_path.is_file() else bin_path.name
            raise DataError(f"indexed dataset {self.prefix!r} is missing {missing}; rebuild it with "
                            f"`tessera data build` (both .bin and .idx are needed)")
        with open(idx_path, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise DataError(f"{idx_path} does not start with Megatron's index header {INDEX_HEADER!r}; "
                            f"it is not a Megatron .idx file — rebuild it")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in DTYPE_CODES:
            raise DataError(f"{idx_path}: version {version} / dtype code {code} unsupported; expected version 1 "
                            f"and a code in {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = 34
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=offset)
        offset += 8 * n_doc
        self.sequence_modes = (np.frombuffer(idx, dtype=np.int8, count=n_seq, offset=offset) if multimodal
                               else None)
        size = bin_path.stat().st_size
        expected = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if size != expected:
            raise DataError(f"{bin_path} holds {size} bytes but its index describes {expected}; the build was "
                            f"interrupted or the files come from different builds — rebuild them")
        self._bin = (np.memmap(bin_path, dtype=self.dtype, mode="r") if size
                     else np.zeros(0, dtype=self.dtype))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence `i` from `offset` (at most `length` of them), as a memmap view."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        stop = start - offset + int(self.sequence_lengths[i])
        if length is not None:
            stop = min(stop, start + length)
        return self._bin[start:stop]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


def import_megatron_builder() -> type:
    """megatron-core's IndexedDatasetBuilder (imported on first use: ~4.5 s; warnings about GPU kernels muted)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    # add_index() runs gc.collect() per merged file, which walks every object torch and megatron created
    # (~0.4 s each); freezing them into the permanent generation makes those collections cheap.
    gc.freeze()
    return IndexedDatasetBuilder  # type: ignore[no-any-return]


def merge_indexed(prefixes: list[str], out_prefix: str | Path, vocab_size: int) -> None:
    """Concatenate .bin/.idx pairs (in order) into one, with megatron-core's `add_index`, atomically."""
    builder_cls = import_megatron_builder()
    tmp = str(out_prefix) + ".tmp"
    builder = builder_cls(tmp + ".bin", dtype=token_dtype(vocab_size))
    for p in prefixes:
        builder.add_index(p)
    builder.finalize(tmp + ".idx")
    Path(tmp + ".bin").replace(str(out_prefix) + ".bin")
    Path(tmp + ".idx").replace(str(out_prefix) + ".idx")


class IndexedWriter:
    """Writes a .bin/.idx pair with megatron-core's `IndexedDatasetBuilder` (so Megatron-LM/NeMo read it).

    Writes to temporary names and renames on `finalize`, so a crashed build never leaves a valid-looking pair.
    """

    def __init__(self, prefix: str | Path, vocab_size: int) -> None:
        builder_cls = import_megatron_builder()
        self.prefix = str(prefix)
        self._tmp = self.prefix + ".tmp"
        self._builder = builder_cls(self._tmp + ".bin", dtype=token_dtype(vocab_size))
        self.num_docs = 0
        self.num_tokens = 0

    def add(self, tokens: np.ndarray | Iterable[int]) -> None:
        """Append one document (already ending with EOS) as one sequence."""
        import torch

        arr = np.asarray(tokens, dtype=np.int64)
        self._builder.add_item(torch.from_numpy(arr))
        self._builder.end_document()
        self.num_docs += 1
        self.num_tokens += int(arr.size)

    def finalize(self) -> None:
        self._builder.finalize(self._tmp + ".idx")
        Path(self._tmp + ".bin").replace(self.prefix + ".bin")
        Path(self._tmp + ".idx").replace(self.prefix + ".idx")
