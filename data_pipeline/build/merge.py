"""The merge stage: each source's token shards (`tokens/<s>/shard-U-K.{bin,idx}`, from tokenize) concatenated into
one Megatron `<s>.bin/.idx`, and the hashes of its kept documents into `<s>.hash.npy` — sharded, with memory per
task independent of the corpus size, and the same bytes whatever the number of tasks.

A source's shards are cut into units of consecutive shards holding about `merge_bytes` of tokens, numbered across
sources (in config order) independently of the task count; task K of N does the units u with u % N == K, in worker
processes, skipping a unit whose marker is there. Every unit writes its region of the source's three outputs in
place, at offsets computed from the shards' .idx headers and .bin sizes (indexed.ConcatPlan). Under
`work/merge/<s>/`:

    <s>.<key>.bin.partial, .idx.partial, .hash.npy.partial   the outputs at their final sizes, each unit writing
                                                              its region
    unit-U.json       unit U's marker: the layout key, its documents by outcome and its token and character
                      counts; written once its bytes are on disk (fsync) = unit done

`key` hashes the source's layout (every shard's name and sizes, the unit size): files of another layout are never
mixed in, and are deleted by the next merge stage. Creating a partial file is idempotent and race-free: each unit
opens it without truncating and gives it the size it must have (`open_sized`), so any number of tasks may write
into one file at once (the output directory must be on a filesystem where processes, on one node or several, can
write disjoint ranges of one file: local disks, Lustre, GPFS; a one-task merge stage is right everywhere).
The manifest stage (task 0) then checks every unit's marker (`finish_source`: a DataError naming a missing unit
and the command that makes it), renames the partials to `<out>/<s>.bin/.idx/.hash.npy` and sums the markers.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.cache import config_key, write_json_atomic
from data_pipeline.build.near_stage import document_status
from data_pipeline.build.shards import CorpusIndex, Shard
from data_pipeline.build.workers import run_pool
from data_pipeline.indexed import ConcatPlan, open_sized, plan_concat, pwrite_all, write_parts
from framework.base.errors import DataError

OUTCOMES = ("kept", "exact_duplicate", "near_duplicate")
EXTS = (".bin", ".idx", ".hash.npy")


@dataclass(frozen=True)
class SourceMerge:
    """One source's merge: its shards, their concatenation plan, its units (shards bounds[u]:bounds[u+1])."""

    name: str
    shards: tuple[Shard, ...]
    plan: ConcatPlan
    bounds: tuple[int, ...]
    key: str
    folder: Path
    out: Path

    @property
    def units(self) -> int:
        return len(self.bounds) - 1

    @property
    def hash_header(self) -> bytes:
        """The .npy header of the kept documents' hashes (uint64, one per document of the concatenation)."""
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint64)),
                                                   "fortran_order": False, "shape": (self.plan.n_documents - 1,)})
        return buf.getvalue()

    def sizes(self) -> dict[str, int]:
        return {".bin": self.plan.bin_bytes, ".idx": self.plan.idx_bytes,
                ".hash.npy": len(self.hash_header) + 8 * (self.plan.n_documents - 1)}

    def partial(self, ext: str) -> Path:
        return self.folder / f"{self.name}.{self.key}{ext}.partial"

    def final(self, ext: str) -> Path:
        return self.out / f"{self.name}{ext}"

    def marker(self, u: int) -> Path:
        return self.folder / f"unit-{u:05d}.json"

    def record(self, u: int) -> dict[str, Any] | None:
        """Unit u's marker, or None when the unit is not done (no marker, or one of another layout)."""
        path = self.marker(u)
        if not path.is_file():
            return None
        rec = json.loads(path.read_text())
        return rec if rec.get("key") == self.key else None

    def describe(self, u: int) -> str:
        lo, hi = self.bounds[u], self.bounds[u + 1]
        return (f"merge unit {u} of source {self.name!r} (shards {self.shards[lo].jsonl.stem}.."
                f"{self.shards[hi - 1].jsonl.stem})")


def source_merges(index: CorpusIndex, out: Path, vocab_size: int) -> list[SourceMerge]:
    """Every source's merge, from its shards' token files (O(shards) header reads); DataError naming the first
    shard whose tokenize output is missing."""
    merges = []
    for src in index.cfg.sources:
        shards = tuple(s for s in index.shards if s.source == src.name)
        for s in shards:
            if not s.file("tokens", ".stats.json").is_file():
                raise DataError(f"{s.file('tokens', '.stats.json')} is missing: the tokenize stage has not "
                                f"finished for every task; run `tessera data build CONFIG --stages tokenize` "
                                f"(all tasks) first")
        plan = plan_concat([s.file("tokens", "") for s in shards], vocab_size)
        bounds, acc = [0], 0
        for k, size in enumerate(plan.bin_sizes.tolist()):
            acc += size
            if acc >= index.cfg.merge_bytes or k == len(shards) - 1:
                bounds.append(k + 1)
                acc = 0
        key = config_key([src.name, plan.code, index.cfg.merge_bytes, [s.jsonl.name for s in shards],
                          plan.bin_sizes.tolist(), plan.sequences.tolist(), plan.documents.tolist()])
        merges.append(SourceMerge(src.name, shards, plan, tuple(bounds), key, index.work / "merge" / src.name, out))
    return merges


_CTX: dict[str, Any] = {}  # the index and merges for forked workers (set before the pool starts)


def merge_stage(index: CorpusIndex, out: Path, vocab_size: int, task: int, tasks: int) -> None:
    """This task's merge units (u % tasks == task, numbered across sources) whose marker is missing."""
    merges = source_merges(index, out, vocab_size)
    jobs, u_all = [], 0
    for i, m in enumerate(merges):
        m.folder.mkdir(parents=True, exist_ok=True)
        for stale in m.folder.glob(f"{m.name}.*.partial"):  # another layout's (an edited merge_bytes, say)
            if not stale.name.startswith(f"{m.name}.{m.key}."):
                stale.unlink(missing_ok=True)
        for u in range(m.units):
            if u_all % tasks == task and m.record(u) is None:
                jobs.append((i, u))
            u_all += 1
    _CTX.update(index=index, merges=merges)
    run_pool(_merge_unit, jobs, index.cfg.workers, "merge")


def _merge_unit(job: tuple[int, int]) -> None:
    i, u = job
    m: SourceMerge = _CTX["merges"][i]
    for ext in EXTS:
        if not m.partial(ext).is_file() and m.final(ext).is_file():
            raise DataError(f"{m.final(ext)} exists but {m.describe(u)} is not done: the merged files were moved "
                            f"there by an interrupted manifest stage (run `tessera data build CONFIG --stages "
                            f"manifest` to finish), or come from other token shards (delete {m.out}/{m.name}.bin, "
                            f".idx, .hash.npy and {m.folder}, and rerun the merge stage)")
    record = _write(m, _CTX["index"], m.bounds[u], m.bounds[u + 1])
    write_json_atomic(m.marker(u), {"key": m.key, **record})


def _write(m: SourceMerge, index: CorpusIndex, lo: int, hi: int) -> dict[str, Any]:
    """Shards lo..hi-1 of `m` into the partial files (their headers too), flushed to disk; their documents by
    outcome and their summed token and character counts. Memory: one shard's index arrays, hashes and status."""
    fds = {ext: open_sized(m.partial(ext), size) for ext, size in m.sizes().items()}
    try:
        write_parts(m.plan, lo, hi, fds[".bin"], fds[".idx"])
        header = m.hash_header
        pwrite_all(fds[".hash.npy"], header, 0)
        at = len(header) + 8 * m.plan.starts(lo)[2]
        docs = dict.fromkeys(OUTCOMES, 0)
        stats: dict[str, Any] = {**dict.fromkeys(OUTCOMES, 0), "chars": dict.fromkeys(OUTCOMES, 0)}
        for k in range(lo, hi):
            shard = m.shards[k]
            st = document_status(index, shard)
            kept = np.load(shard.file("ingest", ".hash.npy"))[st == 0]
            if len(kept) != int(m.plan.documents[k]):
                raise DataError(f"{shard.file('tokens', '.idx')} holds {int(m.plan.documents[k])} documents but "
                                f"{len(kept)} of the shard's are kept: the token file and the dedup results "
                                f"disagree; delete {index.work / 'tokens'} and rerun the tokenize stage")
            pwrite_all(fds[".hash.npy"], kept.astype("<u8"), at)
            at += 8 * len(kept)
            for code, name in enumerate(OUTCOMES):
                docs[name] += int((st == code).sum())
            shard_stats = json.loads(shard.file("tokens", ".stats.json").read_text())
            for name in OUTCOMES:
                stats[name] += shard_stats[name]
                stats["chars"][name] += shard_stats["chars"][name]
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"shards": [lo, hi], "documents": docs, "stats": stats}


def finish_source(m: SourceMerge, index: CorpusIndex) -> list[dict[str, Any]]:
    """Move a source's merged files into place once every unit is done (a DataError naming the first missing unit
    otherwise); returns the units' markers. Rerun after a stop between the renames, it finishes them."""
    records = [m.record(u) for u in range(m.units)]
    missing = [u for u, r in enumerate(records) if r is None]
    if missing:
        raise DataError(f"{m.describe(missing[0])} is not done ({len(missing)} of the source's {m.units} merge units "
                        f"are missing); run `tessera data build CONFIG --stages merge` (all tasks) first")
    if m.units == 0 and not all(m.final(ext).is_file() for ext in EXTS):
        m.folder.mkdir(parents=True, exist_ok=True)
        _write(m, index, 0, 0)  # a source without shards: the headers alone
    for ext, size in m.sizes().items():
        partial, final = m.partial(ext), m.final(ext)
        if partial.is_file():
            if partial.stat().st_size != size:
                raise DataError(f"{partial} holds {partial.stat().st_size} bytes, its plan {size}; delete {m.folder} "
                                f"and rerun `tessera data build CONFIG --stages merge`")
            partial.replace(final)
        elif not (final.is_file() and final.stat().st_size == size):
            raise DataError(f"{partial} is missing though every merge unit of {m.name!r} is done; delete {m.folder} "
                            f"and rerun `tessera data build CONFIG --stages merge`")
    return [r for r in records if r is not None]


def hash_digest(path: Path, digest: Any) -> None:
    """Feed the array data of an .npy file to `digest`, 16 MiB at a time."""
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        while chunk := f.read(1 << 24):
            digest.update(chunk)


__all__ = ["OUTCOMES", "SourceMerge", "finish_source", "hash_digest", "merge_stage", "source_merges"]
