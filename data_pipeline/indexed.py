"""Megatron indexed datasets (.bin/.idx): our numpy-memmap reader, our writer of one shard (the build's tokenize
stage) and our concatenation of many into one (the merge stage), each byte for byte what megatron-core's
`IndexedDatasetBuilder` writes (tests/data_pipeline/test_indexed.py compares the bytes).

The format (megatron-core 0.16.1 `indexed_dataset.py`), all little-endian:
    .idx = b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 n_sequences | u64 n_documents
           | i32 lengths[n_sequences] | i64 byte pointers[n_sequences] | i64 document_indices[n_documents]
           | (i8 modes[n_sequences] when multimodal)
    .bin = the tokens of every sequence, back to back, in the dtype of the code.
Tessera writes one sequence per document (document_indices = 0..n), each ending with EOS.

Nothing here imports megatron-core (~4.5 CPU-s and ~150 MB of RSS on top of torch per process, docs/DATA.md) but
`import_megatron_builder`, which only tests and benches call to compare bytes. Training ranks read with
`IndexedTokens` (numpy only). `IndexedWriter` streams a shard's tokens to the .bin and keeps 4 bytes per document
(megatron-core's builder keeps Python lists of ints, and needs torch tensors). Concatenation (`ConcatPlan`,
`write_parts`): megatron-core's `add_index` holds every document's length and index as Python lists (tens of GB
for 10^9 documents) in one process; ours writes any range of the parts at its computed offsets, so array tasks can
merge one source side by side with memory of one part.
"""

from __future__ import annotations

import array
import errno
import gc
import os
import struct
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from framework.base.errors import DataError

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


HEAD_BYTES = 34
"""Bytes of an .idx header: magic (9), version (u64), dtype code (u8), sequences (u64), documents (u64)."""


def index_head(code: int, n_sequences: int, n_documents: int) -> bytes:
    """The .idx header: magic, version 1, dtype code, sequence and document-index counts."""
    return INDEX_HEADER + struct.pack("<QBQQ", 1, code, n_sequences, n_documents)


@dataclass(frozen=True)
class ConcatPlan:
    """Where each of several .bin/.idx pairs (parts, in order) lands in their concatenation, from the parts' .idx
    headers and .bin sizes alone (O(parts) reads). The concatenation is what megatron-core's
    `IndexedDatasetBuilder.add_index` of every part then `finalize` writes, byte for byte: the parts' tokens back
    to back; lengths concatenated; pointers recomputed from the lengths; document indices [0] + each part's
    (after its leading 0) shifted by the sequences before it.

    Any range of parts can be written (`write_parts`) independently of the others into files preallocated to
    `bin_bytes` / `idx_bytes`, in any order and by any process: the bytes of a range depend on the plan alone."""

    prefixes: tuple[str, ...]
    code: int
    """Megatron dtype code of every part (and of the result)."""
    bin_sizes: np.ndarray
    sequences: np.ndarray
    documents: np.ndarray
    """Per part: its document_indices entries after the leading 0."""

    @property
    def itemsize(self) -> int:
        return np.dtype(DTYPE_CODES[self.code]).itemsize

    @property
    def n_sequences(self) -> int:
        return int(self.sequences.sum())

    @property
    def n_documents(self) -> int:
        return 1 + int(self.documents.sum())

    @property
    def bin_bytes(self) -> int:
        return int(self.bin_sizes.sum())

    @property
    def idx_bytes(self) -> int:
        return HEAD_BYTES + 12 * self.n_sequences + 8 * self.n_documents

    def starts(self, k: int) -> tuple[int, int, int]:
        """(bytes, sequences, documents) of the parts before part k."""
        return (int(self.bin_sizes[:k].sum()), int(self.sequences[:k].sum()), int(self.documents[:k].sum()))

    def head(self) -> bytes:
        """The .idx header, with the concatenation's counts."""
        return index_head(self.code, self.n_sequences, self.n_documents)

    @property
    def doc_offset(self) -> int:
        """Where the document indices start in the .idx."""
        return HEAD_BYTES + 12 * self.n_sequences


def read_index_head(idx_path: Path) -> tuple[int, int, int]:
    """(dtype code, sequences, documents) of a text (not multimodal) .idx, its size checked against them."""
    with open(idx_path, "rb") as f:
        head = f.read(HEAD_BYTES)
    if len(head) < HEAD_BYTES or head[:9] != INDEX_HEADER:
        raise DataError(f"{idx_path} does not start with Megatron's index header {INDEX_HEADER!r}; it is not a "
                        f"Megatron .idx file — rebuild it")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    size = idx_path.stat().st_size
    if version != 1 or code not in DTYPE_CODES or size != HEAD_BYTES + 12 * n_seq + 8 * n_doc:
        raise DataError(f"{idx_path}: version {version}, dtype code {code}, {n_seq} sequences and {n_doc} documents "
                        f"do not describe its {size} bytes (expected version 1, a code in {sorted(DTYPE_CODES)}, "
                        f"no multimodal modes); it was cut short or comes from elsewhere — rebuild it")
    return code, n_seq, n_doc


def plan_concat(prefixes: Sequence[str | Path], vocab_size: int) -> ConcatPlan:
    """The ConcatPlan of `prefixes` (each `p.idx` and `p.bin`), whose dtype must be the vocabulary's."""
    code = _code(token_dtype(vocab_size))
    sizes, seqs, docs = (np.zeros(len(prefixes), dtype=np.int64) for _ in range(3))
    for k, p in enumerate(prefixes):
        got, seqs[k], n_doc = read_index_head(Path(f"{p}.idx"))
        if got != code:
            raise DataError(f"{p}.idx holds {np.dtype(DTYPE_CODES[got])} tokens, but a vocabulary of {vocab_size} "
                            f"is written as {np.dtype(DTYPE_CODES[code])}; it comes from another tokenizer — "
                            f"rebuild its tokenize stage")
        docs[k] = max(0, n_doc - 1)
        sizes[k] = Path(f"{p}.bin").stat().st_size
    return ConcatPlan(tuple(str(p) for p in prefixes), code, sizes, seqs, docs)


def _code(dtype: type[np.number[Any]]) -> int:
    return next(c for c, d in DTYPE_CODES.items() if d == dtype)


def pwrite_all(fd: int, data: bytes | memoryview | np.ndarray, offset: int) -> None:
    """Write all of `data` at `offset` of `fd` (pwrite may write less than asked)."""
    view = (np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def copy_range(src: int, dst: int, count: int, offset_dst: int) -> None:
    """Copy `count` bytes from the start of `src` to `offset_dst` of `dst`: in-kernel (`copy_file_range`, a
    reflink where the filesystem has them), else through an 8 MiB buffer."""
    done = 0
    try:
        while done < count:
            n = os.copy_file_range(src, dst, count - done, done, offset_dst + done)
            if n == 0:
                raise DataError(f"a token file ended {count - done} bytes early while being merged; rebuild its "
                                f"tokenize stage")
            done += n
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            raise
        while done < count:
            buf = os.pread(src, min(COPY_CHUNK, count - done), done)
            if not buf:
                raise DataError(f"a token file ended {count - done} bytes early while being merged; rebuild its "
                                f"tokenize stage") from err
            pwrite_all(dst, buf, offset_dst + done)
            done += len(buf)


COPY_CHUNK = 1 << 23


def write_parts(plan: ConcatPlan, lo: int, hi: int, bin_fd: int, idx_fd: int) -> None:
    """Write parts lo..hi-1 of `plan` (and the header) at their offsets of the concatenation's .bin and .idx
    (open for writing, at their final sizes). Memory: one part's index arrays (~40 bytes per sequence)."""
    pwrite_all(idx_fd, plan.head(), 0)
    pwrite_all(idx_fd, np.zeros(1, dtype="<i8"), plan.doc_offset)
    n_seq, itemsize = plan.n_sequences, plan.itemsize
    byte0, seq0, doc0 = plan.starts(lo)
    for k in range(lo, hi):
        prefix, seqs, docs = plan.prefixes[k], int(plan.sequences[k]), int(plan.documents[k])
        lengths = np.fromfile(f"{prefix}.idx", dtype="<i4", count=seqs, offset=HEAD_BYTES)
        doc_index = np.fromfile(f"{prefix}.idx", dtype="<i8", count=docs + 1, offset=HEAD_BYTES + 12 * seqs)[1:]
        ends = np.cumsum(lengths, dtype=np.int64) * itemsize
        if (int(ends[-1]) if seqs else 0) != int(plan.bin_sizes[k]):
            raise DataError(f"{prefix}.bin holds {int(plan.bin_sizes[k])} bytes but its index describes "
                            f"{int(ends[-1]) if seqs else 0}; the tokenize stage was interrupted or the files "
                            f"come from different builds — rebuild it")
        pwrite_all(idx_fd, lengths, HEAD_BYTES + 4 * seq0)
        pwrite_all(idx_fd, (ends - lengths.astype(np.int64) * itemsize) + byte0, HEAD_BYTES + 4 * n_seq + 8 * seq0)
        pwrite_all(idx_fd, doc_index + seq0, plan.doc_offset + 8 * (1 + doc0))
        with open(f"{prefix}.bin", "rb") as f:
            copy_range(f.fileno(), bin_fd, int(plan.bin_sizes[k]), byte0)
        byte0, seq0, doc0 = byte0 + int(plan.bin_sizes[k]), seq0 + seqs, doc0 + docs


def open_sized(path: Path, size: int) -> int:
    """A file descriptor of `path` open for writing, the file `size` bytes long: created if missing (never
    truncated on open), and resized only when its size differs, so any number of processes may open it at once
    and write their own regions (ftruncate to the size a file already has changes nothing; one process's
    extension zero-fills only past the old end, where nobody has written yet)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)
    return fd


BIN_BUFFER = 1 << 20
"""Write buffer of `IndexedWriter`'s .bin (documents are a few KB; one write call per MiB)."""


class IndexedWriter:
    """Writes a .bin/.idx pair, byte for byte what megatron-core's `IndexedDatasetBuilder` writes for the same
    documents through `add_item(torch.from_numpy(tokens))` + `end_document()` each, then `finalize` (tested: random
    documents, empty ones, no documents, uint16 and int32), so Megatron-LM/NeMo read it — without importing
    megatron-core or torch.

    Tokens go to the .bin as documents come (cast to the vocabulary's dtype as megatron-core casts, through int64);
    the only state kept is one int32 length per document (4 bytes, in an `array`); `finalize` writes the .idx:
    header, lengths, byte pointers (their exclusive prefix sums x itemsize) and document indices 0..n (one sequence
    per document). Writes to temporary names (`prefix.tmp.bin`, `prefix.tmp.idx`, truncated when opened) and renames
    the .bin then the .idx on `finalize`, so a crashed build never leaves a valid-looking pair.
    """

    def __init__(self, prefix: str | Path, vocab_size: int) -> None:
        self.prefix = str(prefix)
        self._tmp = self.prefix + ".tmp"
        dtype = token_dtype(vocab_size)
        self.dtype = np.dtype(dtype)
        self._code = _code(dtype)
        self._bin = open(self._tmp + ".bin", "wb", buffering=BIN_BUFFER)  # closed by finalize
        self._lengths = array.array("i")
        if self._lengths.itemsize != 4:
            raise RuntimeError(f"C int is {self._lengths.itemsize} bytes here; the .idx needs 4-byte lengths")
        self.num_docs = 0
        self.num_tokens = 0

    def add(self, tokens: np.ndarray | Iterable[int]) -> None:
        """Append one document (already ending with EOS) as one sequence."""
        arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64), dtype=self.dtype)
        self._bin.write(arr.data.cast("B"))
        self._lengths.append(arr.size)
        self.num_docs += 1
        self.num_tokens += arr.size

    def finalize(self) -> None:
        self._bin.close()
        n = len(self._lengths)
        lengths = np.frombuffer(self._lengths, dtype=np.intc).astype("<i4")
        pointers = np.zeros(n, dtype="<i8")
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(self._tmp + ".idx", "wb") as f:
            f.write(index_head(self._code, n, n + 1))
            for part in (lengths, pointers, np.arange(n + 1, dtype="<i8")):
                f.write(part.data)
        Path(self._tmp + ".bin").replace(self.prefix + ".bin")
        Path(self._tmp + ".idx").replace(self.prefix + ".idx")
