"""Whole matrices from sharded parameters: gather each onto one owner rank, apply a function there, scatter back.

Muon (framework/train/muon.py) orthogonalizes whole matrices, while ZeRO-1/2/3 (FSDP2 `Shard(0)`, uneven shards
included), HSDP, TP (`Colwise` / `Rowwise` shards, `_StridedShard` under FSDP x TP) and EP cut them into pieces.
`WholeMatrices` hides the cut: given every rank's local pieces of the same list of parameters it returns the
local pieces of `fn(full matrix)`, with each matrix's function evaluated once per replica, on one owner rank.

How the pieces travel (a parameter's mesh dims sorted by its placements):
  replicated dims   (`Replicate`, e.g. dp_replicate under HSDP): every replica repeats the work on its own copy;
  whole-unit dims   (a stacked expert tensor `(E, A, B)` sharded on dim 0, e.g. `ep`): each rank already holds
                    whole experts, nothing moves along them;
  the primary dim   (the first other shard dim, e.g. dp_shard): one bucketed `all_to_all_single` per step sends
                    every piece to its matrix's owner, round-robin by parameter over the dim's ranks (owners
                    differ within one FSDP group, so the work is spread); a second one returns the results;
  flat              (`WholeMatrices(..., flat=group)`, Muon's overlapped exchange under FSDP x TP): a group of
                    every rank along the cut dims is the primary, each rank's own piece goes straight to the
                    owner, one owner among dp_shard x tp; no secondary hop (`_plan_flat`);
  secondary dims    (further shard dims, e.g. tp under FSDP x TP): one bucketed all-gather per dim
                    before the primary exchange; the ranks of such a dim then compute the same matrices (the
                    "orthogonalize the full matrix" choice: tp is small and inside a node, and it spares a
                    second level of owners at the cost of tp-fold Newton-Schulz work on those ranks).
Owners put the pieces in place through flat positions in the unit, which every owner computes for itself from
rank arithmetic (each rank's piece is what `distribute_tensor` cuts for its mesh coordinate: one code path for
Shard, _StridedShard and uneven shards), as every rank computes the piece lengths: building the plan exchanges
nothing, so a fake process group (`tessera dryrun`) builds the same plan and measures the same traffic. Where the
received pieces already lie in order (a 2-D matrix cut in row blocks on one dim: FSDP's Shard(0) alone, the
common case) the owner keeps no index and assembles by concatenation; elsewhere its indices cost 4 bytes (int32)
per element of the matrices it owns, kept between steps. The collectives are c10d ops, so
the communication logger (framework/parallel/comm.py) sees their bytes on their mesh axes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single (the same c10d op); older torch lacks the latter.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

MatrixFn = Callable[[torch.Tensor], torch.Tensor]
"""fn(x) for x of shape (n, A, B) (n matrices of one shape stacked), returning the same shape."""


def _is_shard(placement: object) -> bool:
    # FSDP over a TP-sharded dim uses _StridedShard, which is not a Shard subclass and says is_shard() False.
    return isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard"


def _shard_dim(placement: object) -> int:
    return int(placement.dim)  # type: ignore[attr-defined]


@dataclass
class _Param:
    """How one parameter's whole matrices are assembled (everything but the data, fixed at construction)."""

    unit_shape: tuple[int, ...]  # what the owner assembles: (A, B), or (E_local, A, B) for stacked experts
    secondary: list[tuple[dist.ProcessGroup, list[int], int]] = field(default_factory=list)
    # per secondary hop: (group, buffer length of every member before the hop, my position in the group)
    own_offset: int = 0  # where this rank's piece sits in its buffer after the secondary hops
    own_numel: int = 0
    cut: list[int] = field(default_factory=list)  # the mesh dims that cut the unit: primary first, then secondary
    owner: int = -1  # rank in the primary group (-1: no primary dim, the unit is assembled locally)
    recv_lengths: list[int] = field(default_factory=list)  # owner: buffer length from each primary member
    index: torch.Tensor | None = None  # owner: flat positions in the unit of the received elements, in order;
    # None where they are 0, 1, 2, ... (FSDP's Shard(0) alone: the pieces are row blocks in rank order)
    flat: list[tuple[int, ...]] | None = None  # one primary group over all the cut dims: each member's
    # coordinate along them, in group rank order (`WholeMatrices(..., flat=...)`)


@dataclass
class _Bucket:
    """Parameters sharing one primary group (one all-to-all each way per step)."""

    group: dist.ProcessGroup
    members: list[int]  # indices into the parameter list


def _split_dims(p: torch.Tensor) -> tuple[list[int], list[int]]:
    """(shard mesh dims that cut a unit, whole-unit mesh dims) of a DTensor with more than one rank on them."""
    if not isinstance(p, DTensor):
        return [], []
    cut: list[int] = []
    whole: list[int] = []
    for d, pl in enumerate(p.placements):
        if not _is_shard(pl) or p.device_mesh.size(d) == 1:
            continue
        (whole if p.ndim == 3 and _shard_dim(pl) == 0 else cut).append(d)
    return cut, whole


def _split(p: DTensor, d: int, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's chunk of `t` along mesh dim d, as `distribute_tensor` cuts it (uneven and strided alike)."""
    chunks, _ = p.placements[d]._split_tensor(  # type: ignore[attr-defined]
        t, p.device_mesh.size(d), with_padding=False, contiguous=False)
    return list(chunks)


def _unit_shape(p: DTensor, whole: list[int]) -> tuple[int, ...]:
    """The shape of this rank's unit: the whole matrix, or its block of whole experts along the whole-unit dims."""
    t = torch.empty(p.shape, device="meta")
    coordinate = p.device_mesh.get_coordinate()
    assert coordinate is not None
    for d in whole:
        t = _split(p, d, t)[coordinate[d]]
    return tuple(t.shape)


def _pieces(p: DTensor, cut: list[int], unit: torch.Tensor) -> dict[tuple[int, ...], torch.Tensor]:
    """{(k along cut[0], k along cut[1], ...): that rank's piece of `unit`} for every rank of the cut dims (the
    other dims at this rank's coordinate): rank arithmetic, no collective. Whole-unit dims cut only dim 0 of a
    stacked expert tensor, which the cut dims never cut, so cutting the unit by the cut dims alone is exact."""
    out: dict[tuple[int, ...], torch.Tensor] = {(): unit}
    for d in cut:  # ascending mesh dims: the order distribute_tensor applies placements in
        out = {(*key, k): chunk for key, t in out.items() for k, chunk in enumerate(_split(p, d, t))}
    return out


def _all_gather_flat(pieces: list[torch.Tensor], lengths: list[list[int]], group: dist.ProcessGroup
                     ) -> list[torch.Tensor]:
    """Per parameter, the concatenation over the group's members of their pieces (`lengths[i][k]`: member k's)."""
    size = len(lengths[0]) if lengths else 1
    widths = [max(ls) for ls in lengths]
    send = torch.cat([torch.nn.functional.pad(x, (0, w - x.numel())) for x, w in zip(pieces, widths, strict=True)])
    out = send.new_empty(size * send.numel())
    _all_gather_single(out, send, group=group)
    rows = out.view(size, -1)
    result, start = [], 0
    for ls, w in zip(lengths, widths, strict=True):
        result.append(torch.cat([rows[k, start:start + ls[k]] for k in range(size)]))
        start += w
    return result


def _plan(p: DTensor, cut: list[int], whole: list[int]) -> _Param:
    """Lengths and offsets of one parameter's pieces on their way to the owner, from rank arithmetic alone (every
    rank's piece size is what `distribute_tensor` would cut for it), so nothing is exchanged to plan and a fake
    process group (`tessera dryrun`) plans exactly as a real one."""
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    unit_shape = _unit_shape(p, whole)
    numel = {k: t.numel() for k, t in _pieces(p, cut, torch.empty(unit_shape, device="meta")).items()}
    mine = tuple(coordinate[d] for d in cut)
    sizes = [mesh.size(d) for d in cut]
    layout = _Param(unit_shape=unit_shape, own_numel=numel[mine], cut=cut)
    for hop in range(1, len(cut)):
        # member k's buffer before this hop: its pieces gathered over the hops before (dims cut[1:hop])
        lengths = [sum(numel[mine[:1] + inner + (k,) + mine[hop + 1:]] for inner in _every(sizes[1:hop]))
                   for k in range(sizes[hop])]
        layout.secondary.append((mesh.get_group(cut[hop]), lengths, mine[hop]))
        layout.own_offset += sum(lengths[:mine[hop]])
    layout.recv_lengths = [sum(numel[(k, *rest)] for rest in _every(sizes[1:])) for k in range(sizes[0])]
    return layout


def _plan_flat(p: DTensor, cut: list[int], whole: list[int], group: dist.ProcessGroup) -> _Param | None:
    """`_plan` with one primary group over every cut dim (None where `group`'s members are not this rank's ranks
    along them): every member sends its own piece straight to the owner, so no secondary hop runs and one rank of
    the group owns each matrix (FSDP x TP: the dp_shard x tp ranks, not one owner per tp rank)."""
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    grid: Any = mesh.mesh.tolist()  # nested lists: no tensor reads, which a fake tensor mode would fake
    where: dict[int, tuple[int, ...]] = {}  # the global rank at each coordinate along the cut dims
    for k in itertools.product(*(range(mesh.size(d)) for d in cut)):
        at = dict(zip(cut, k, strict=True))
        rank = grid
        for d in range(mesh.ndim):
            rank = rank[at.get(d, coordinate[d])]
        where[int(rank)] = k
    members = dist.get_process_group_ranks(group)
    if sorted(members) != sorted(where):
        return None
    unit_shape = _unit_shape(p, whole)
    numel = {k: t.numel() for k, t in _pieces(p, cut, torch.empty(unit_shape, device="meta")).items()}
    flat = [where[r] for r in members]
    return _Param(unit_shape=unit_shape, own_numel=numel[tuple(coordinate[d] for d in cut)], cut=cut,
                  recv_lengths=[numel[k] for k in flat], flat=flat)


def _every(sizes: list[int]) -> list[tuple[int, ...]]:
    """Every coordinate over dims of these sizes, the first fastest (the order the secondary hops concatenate)."""
    return [tuple(reversed(k)) for k in itertools.product(*(range(n) for n in reversed(sizes)))]


def _owner_index(p: DTensor, layout: _Param) -> torch.Tensor | None:
    """The owner's flat positions in the unit of the elements it receives, in arrival order; None where that order
    is 0, 1, 2, ... (a 2-D matrix cut into row blocks on one dim: FSDP's Shard(0), TP's Colwise)."""
    placement = p.placements[layout.cut[0]]
    if (layout.flat is None and len(layout.cut) == 1 and p.ndim == 2 and isinstance(placement, Shard)
            and _shard_dim(placement) % 2 == 0):
        return None
    n = math.prod(layout.unit_shape)  # int32 where it can address the unit: half the bytes the owner keeps
    unit = torch.arange(n, dtype=torch.int32 if n < 2**31 else torch.int64, device=p.to_local().device)
    pieces = _pieces(p, layout.cut, unit.view(layout.unit_shape))
    sizes = [p.device_mesh.size(d) for d in layout.cut]
    order = layout.flat or [(k, *rest) for k in range(sizes[0]) for rest in _every(sizes[1:])]
    return torch.cat([pieces[k].reshape(-1) for k in order])


class WholeMatrices:
    """Gather, apply, scatter for a fixed list of parameters (the Muon parameters of one optimizer)."""

    def __init__(self, params: Sequence[torch.Tensor], blocks: Sequence[int] | None = None,
                 flat: dist.ProcessGroup | None = None) -> None:
        """`blocks[i]`: 0, or +k / -k to run `fn` on the unit's row / column blocks of k (one matrix each);
        `flat`: a group of every rank along a parameter's cut dims (ParallelDims.build_mesh's dp_shard x tp), over
        which such parameters go to their owners in one hop (`_plan_flat`)."""
        self.params = list(params)
        self.blocks = list(blocks or [0] * len(self.params))
        self.layout: list[_Param] = []
        buckets: dict[tuple[int, ...], _Bucket] = {}
        for i, p in enumerate(self.params):
            cut, whole = _split_dims(p)
            if not cut:  # the local tensor holds whole units: a plain tensor, replicas, whole experts
                self.layout.append(_Param(unit_shape=tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)))
                continue
            assert isinstance(p, DTensor)
            one = _plan_flat(p, cut, whole, flat) if flat is not None and len(cut) > 1 else None
            self.layout.append(one or _plan(p, cut, whole))
            group = flat if flat is not None and one is not None else p.device_mesh.get_group(cut[0])
            key = (id(group), *(id(g) for g, _, _ in self.layout[i].secondary))
            buckets.setdefault(key, _Bucket(group, [])).members.append(i)
        self.buckets = list(buckets.values())
        self._inflight: list[tuple[_Bucket, list[int], torch.Tensor, dist.Work | None]] = []
        self._sent: set[int] = set()
        for bucket in self.buckets:
            size, me = dist.get_world_size(bucket.group), dist.get_rank(bucket.group)
            for n, i in enumerate(bucket.members):
                self.layout[i].owner = n % size
                if n % size == me:
                    self.layout[i].index = _owner_index(self.params[i], self.layout[i])  # type: ignore[arg-type]

    def _secondary_hops(self, bucket: _Bucket, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """All-gather along each secondary dim (bucketed per dim)."""
        for hop in range(len(self.layout[bucket.members[0]].secondary)):
            lengths_P = [self.layout[i].secondary[hop][1] for i in bucket.members]
            pieces = _all_gather_flat(pieces, lengths_P, self.layout[bucket.members[0]].secondary[hop][0])
        return pieces

    def _to_owners(self, bucket: _Bucket, buffers: list[torch.Tensor], members: list[int] | None = None,
                   async_op: bool = False) -> tuple[torch.Tensor, dist.Work | None]:
        """One all-to-all: every buffer (of `members`, the bucket's by default) to its owner; returns the receive
        buffer (split by `_received`) and, with `async_op`, the work to wait on."""
        members = bucket.members if members is None else members
        size = dist.get_world_size(bucket.group)
        me = dist.get_rank(bucket.group)
        by_owner: list[list[torch.Tensor]] = [[] for _ in range(size)]
        for i, buf in zip(members, buffers, strict=True):
            by_owner[self.layout[i].owner].append(buf)
        send = torch.cat([x for per in by_owner for x in per])
        in_splits = [sum(x.numel() for x in per) for per in by_owner]
        del by_owner
        buffers.clear()  # the caller's gathered buffers, now copied into `send`: freed before the owner's copies
        mine = [i for i in members if self.layout[i].owner == me]
        out_splits = [sum(self.layout[i].recv_lengths[k] for i in mine) for k in range(size)]
        recv = send.new_empty(sum(out_splits))
        work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=bucket.group, async_op=async_op)
        return recv, work

    def _received(self, bucket: _Bucket, recv: torch.Tensor, members: list[int] | None = None
                  ) -> dict[int, torch.Tensor]:
        """{parameter index: its unit} of what `_to_owners` delivered to this owner."""
        members = bucket.members if members is None else members
        mine = [i for i in members if self.layout[i].owner == dist.get_rank(bucket.group)]
        parts: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
        start = 0
        for k in range(dist.get_world_size(bucket.group)):
            for i in mine:
                n = self.layout[i].recv_lengths[k]
                parts[i].append(recv[start:start + n])
                start += n
        return {i: self._place(i, torch.cat(ps)) for i, ps in parts.items()}

    def _place(self, i: int, data: torch.Tensor) -> torch.Tensor:
        """The owner's unit of parameter i from its received elements in arrival order."""
        layout = self.layout[i]
        if layout.index is None:
            return data.view(layout.unit_shape)
        unit = data.new_empty(math.prod(layout.unit_shape))
        unit[layout.index] = data
        return unit.view(layout.unit_shape)

    def _from_owners(self, bucket: _Bucket, results: dict[int, torch.Tensor], like: torch.Tensor
                     ) -> list[torch.Tensor]:
        """The reverse all-to-all: every member gets back, per parameter, its buffer's share of the result."""
        size = dist.get_world_size(bucket.group)
        me = dist.get_rank(bucket.group)
        mine = [i for i in bucket.members if self.layout[i].owner == me]
        in_splits = [sum(self.layout[i].recv_lengths[k] for i in mine) for k in range(size)]
        send = like.new_empty(sum(in_splits))
        at = 0
        for k in range(size):  # written in place: no per-piece copies beside the send buffer
            for i in mine:
                layout = self.layout[i]
                start, stop = sum(layout.recv_lengths[:k]), sum(layout.recv_lengths[:k + 1])
                flat, part = results[i].reshape(-1), send[at:at + stop - start]
                if layout.index is None:
                    part.copy_(flat[start:stop])
                else:
                    torch.index_select(flat, 0, layout.index[start:stop], out=part)
                at += stop - start
        by_owner: list[list[int]] = [[] for _ in range(size)]
        for i in bucket.members:
            by_owner[self.layout[i].owner].append(i)
        out_splits = [sum(self._buffer_len(i) for i in per) for per in by_owner]
        recv = like.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=bucket.group)
        out: dict[int, torch.Tensor] = {}
        start = 0
        for per in by_owner:
            for i in per:
                out[i] = recv[start:start + self._buffer_len(i)]
                start += self._buffer_len(i)
        return [out[i] for i in bucket.members]

    def _buffer_len(self, i: int) -> int:
        """This rank's buffer length for parameter i after the secondary hops."""
        layout = self.layout[i]
        return sum(layout.secondary[-1][1]) if layout.secondary else layout.own_numel

    def apply(self, pieces: Sequence[torch.Tensor], fn: MatrixFn) -> list[torch.Tensor]:
        """The local pieces of fn(whole matrix) for every parameter, given `pieces[i]`, this rank's local piece of
        a tensor placed like `params[i]` (e.g. its Nesterov momentum). Matrices of one shape go through `fn`
        together, stacked, whatever parameter (or expert) they come from."""
        return self.scatter(_batched(self.units(pieces), fn, self.blocks), pieces)

    def units(self, pieces: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """This rank's units (the whole matrices it owns, and the local units of unexchanged parameters) of the
        tensors whose local pieces are `pieces`, in `apply`'s order: the unexchanged ones, then bucket by bucket."""
        units = {i: pieces[i].reshape(layout.unit_shape) for i, layout in enumerate(self.layout) if layout.owner < 0}
        for bucket in self.buckets:
            buffers = self._secondary_hops(bucket, [pieces[i].reshape(-1) for i in bucket.members])
            units.update(self._received(bucket, self._to_owners(bucket, buffers)[0]))
        return units

    def scatter(self, results: dict[int, torch.Tensor], pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The local pieces, shaped like `pieces`, of the tensors whose units this rank holds in `results` (the
        reverse all-to-all from the owners; unexchanged parameters' units are local already)."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for i, layout in enumerate(self.layout):
            if layout.owner < 0:
                out[i] = results[i].reshape(pieces[i].shape)
        for bucket in self.buckets:
            like = pieces[bucket.members[0]]
            back = self._from_owners(bucket, {i: results[i] for i in bucket.members if i in results}, like)
            for i, buf in zip(bucket.members, back, strict=True):
                layout = self.layout[i]
                out[i] = buf[layout.own_offset:layout.own_offset + layout.own_numel].view(pieces[i].shape)
        return out  # type: ignore[return-value]

    # --- the exchange overlapped with backward (framework/train/muon_overlap.py) -----------------------------
    def launch(self, ids: Sequence[int], pieces: Sequence[torch.Tensor]) -> None:
        """Start sending `pieces[j]`, this rank's local piece of a tensor placed like `params[ids[j]]`, to its
        owner: one asynchronous all-to-all per bucket touched, over those parameters only; `collect` waits. Every
        rank launches the same `ids` in the same order. Parameters with secondary hops are not launched."""
        local = dict(zip(ids, pieces, strict=True))
        for bucket in self.buckets:
            members = [i for i in bucket.members if i in local]
            if not members:
                continue
            if self.layout[members[0]].secondary or self._sent.intersection(members):
                raise RuntimeError(f"launching Muon parameters {members}: sent already this step, or they need a "
                                   "secondary hop (tp under FSDP), which the overlapped exchange does not run")
            recv, work = self._to_owners(bucket, [local[i].reshape(-1) for i in members], members, async_op=True)
            self._inflight.append((bucket, members, recv, work))
            self._sent.update(members)

    def unsent(self) -> list[int]:
        """The exchanged parameters (owner >= 0) not launched since the last `collect` / `discard`."""
        return [i for bucket in self.buckets for i in bucket.members if i not in self._sent]

    def collect(self) -> dict[int, torch.Tensor]:
        """Wait for everything `launch` started; this owner's units {parameter index: unit}, in `apply`'s order."""
        got: dict[int, torch.Tensor] = {}
        for bucket, members, recv, work in self._inflight:
            if work is not None:
                work.wait()
            got.update(self._received(bucket, recv, members))
        self._inflight.clear()
        self._sent.clear()
        return {i: got[i] for bucket in self.buckets for i in bucket.members if i in got}

    def discard(self) -> None:
        """Drop what `launch` sent (a skipped step): wait for the collectives, keep nothing."""
        for _, _, _, work in self._inflight:
            if work is not None:
                work.wait()
        self._inflight.clear()
        self._sent.clear()


def _to_blocks(unit: torch.Tensor, block: int) -> torch.Tensor:
    """(n, a, b) matrices of a unit: itself, its row blocks of `block` (> 0) or its column blocks of -`block`."""
    if block > 0:
        return unit.reshape(-1, block, unit.shape[-1])
    if block < 0:
        return unit.reshape(unit.shape[-2], -1, -block).transpose(0, 1)
    return unit.reshape(-1, unit.shape[-2], unit.shape[-1])


def _from_blocks(blocks_NAB: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    if block < 0:
        return blocks_NAB.transpose(0, 1).reshape(shape)
    return blocks_NAB.reshape(shape)


def _batched(units: dict[int, torch.Tensor], fn: MatrixFn, blocks: Sequence[int]) -> dict[int, torch.Tensor]:
    """fn over every unit's matrices (`_to_blocks`), one call per matrix shape (units of shape (A, B) or
    (E, A, B)); each unit leaves `units` once stacked, so a shape's inputs are freed before the next shape's
    Newton-Schulz."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    shapes = {i: u.shape for i, u in units.items()}
    for i in shapes:  # no loop variable may hold a unit: it would outlive its pop below (a whole matrix per owner)
        a, b = _to_blocks(units[i], blocks[i]).shape[-2:]
        by_shape.setdefault((a, b), []).append(i)
    out: dict[int, torch.Tensor] = {}
    for (a, b), ids in by_shape.items():
        stacked = torch.cat([_to_blocks(units.pop(i), blocks[i]) for i in ids])
        result = fn(stacked)
        del stacked  # before the next shape's stack
        start = 0
        for i in ids:
            n = shapes[i].numel() // (a * b)
            out[i] = _from_blocks(result[start:start + n], shapes[i], blocks[i])
            start += n
    return out
