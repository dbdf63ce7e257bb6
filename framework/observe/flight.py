"""Reading flight records: which collective hung, on which group, and which rank(s) never issued it.

torch's flight recorder (TORCH_FR_BUFFER_SIZE; TORCH_NCCL_TRACE_BUFFER_SIZE before torch 2.7) keeps each rank's
last collectives: the process group, a per-group sequence number, the op. Two writers put them in
`<run dir>/nccl_trace/`: NCCL's watchdog on a collective timeout (`rank_R`, rendered SLURM jobs set
TORCH_NCCL_DUMP_ON_TIMEOUT and the file prefix), and Tessera's hang watchdog on every backend, gloo included
(`rank_R.watchdog`, with the group table `groups`: name -> description and member ranks). Both are pickles of
`torch._C._distributed_c10d._dump_fr_trace()`'s dict.

On a group, the ranks that reached sequence number S of a collective wait for the members whose last number is
below S: those never called it (behind, dead, or on another code path).
"""

from __future__ import annotations

import ast
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_RANK = re.compile(r"rank_(\d+)")


@dataclass(frozen=True)
class StuckCollective:
    op: str
    """The collective (all_reduce, all_gather, ...)."""
    group: str
    """The group's description (its mesh axis name where the framework named it) or its name."""
    group_ranks: list[int]
    seq: int
    waiting: list[int]
    missing: list[int]
    """Members whose last collective on the group is below `seq`; members without any record are listed too."""
    last_seq: dict[int, int]


class _PlainData(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numbers only: a run directory may come from another machine, and a
    pickle naming any class or function could run code when `doctor` reads it (flight records hold plain data)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}: a flight record holds plain data only")


def read_flight(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Each rank's flight record (the watchdog's when both writers left one); a file that is not plain data is
    skipped like an unreadable one."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted((run_dir / "nccl_trace").glob("rank_*"), key=lambda p: p.name.endswith(".watchdog")):
        m = _RANK.match(path.name)
        try:
            with path.open("rb") as f:
                record = _PlainData(f).load()
        except Exception:
            continue
        if m and isinstance(record, dict):
            out[int(m.group(1))] = record
    return out


def _groups(records: dict[int, dict[str, Any]]) -> dict[str, tuple[str, list[int]]]:
    """Group name -> (description, member ranks), from the watchdog's table or NCCL's pg_config."""
    out: dict[str, tuple[str, list[int]]] = {}
    for record in records.values():
        for name, g in (record.get("pg_config") or {}).items():
            ranks = g.get("ranks", "[]")
            ranks = ast.literal_eval(ranks) if isinstance(ranks, str) else ranks
            if name and ranks:
                out[str(name)] = (str(g.get("desc") or name), [int(r) for r in ranks])
        for name, g in (record.get("groups") or {}).items():
            out[str(name)] = (str(g["desc"] or name), [int(r) for r in g["ranks"]])
    return out


def stuck_collectives(records: dict[int, dict[str, Any]]) -> list[StuckCollective]:
    """Every group on which some members issued a collective that others never did, latest first."""
    last: dict[str, dict[int, tuple[int, str, int]]] = {}  # group -> rank -> (seq, op, time)
    for rank, record in records.items():
        for e in record.get("entries", []):
            if e.get("is_p2p"):
                continue
            name = str(e["process_group"][0])
            seq = int(e["collective_seq_id"])
            if seq >= last.setdefault(name, {}).get(rank, (-1, "", 0))[0]:
                op = str(e.get("profiling_name", "?")).split(":")[-1]
                last[name][rank] = (seq, op, int(e.get("time_created_ns") or 0))
    groups = _groups(records)
    out: list[tuple[int, StuckCollective]] = []
    for name, by_rank in last.items():
        desc, members = groups.get(name, (name, sorted(by_rank)))
        top = max(s for s, _, _ in by_rank.values())
        missing = [r for r in members if by_rank.get(r, (-1, "", 0))[0] < top]
        if not missing:
            continue
        op, when = next((o, t) for s, o, t in by_rank.values() if s == top)
        waiting = [r for r in members if by_rank.get(r, (-1, "", 0))[0] == top]
        out.append((when, StuckCollective(op, desc, members, top, waiting, missing,
                                          {r: by_rank[r][0] for r in members if r in by_rank})))
    return [s for _, s in sorted(out, key=lambda x: -x[0])]


def describe(s: StuckCollective) -> str:
    gone = ", ".join(f"rank {r} (last seq {s.last_seq[r]})" if r in s.last_seq else f"rank {r} (no record)"
                     for r in s.missing)
    return (f"{s.op} #{s.seq} on group {s.group} (ranks {s.group_ranks}): ranks {s.waiting} wait in it; "
            f"never issued by {gone}")
