"""`ParallelDims.build_mesh` with context parallelism (framework/parallel/mesh.py): FSDP shards over dp_shard x cp,
which `fsdp_mesh` (framework/parallel/zero.py) reads off the root axis "dp_shard_cp" that build_mesh unflattens
into dp_shard and cp — over the whole world and over a sub-world (`ranks=`, what the dry run builds). The
reference for the ranks is ParallelDims' own rank arithmetic (`coords`, golden-tested at thousands of ranks):
a shard group is every rank that agrees with this one on pp, dp_replicate and tp. Built on torch's fake
process-group backend in this process (no ranks to spawn: rank 0 of 16 creates its groups)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from framework.config import load_config
from framework.parallel.mesh import ParallelDims
from framework.parallel.zero import fsdp_mesh
from framework.testing.tiny import TINY


def _dims(cp: int, world: int) -> ParallelDims:
    cfg = load_config(TINY, [f"parallel.cp={cp}", "parallel.dp_shard=-1", "parallel.tp=2"])
    return ParallelDims.from_config(cfg.parallel, world, cfg.model)


def _shard_group(dims: ParallelDims, rank: int, ranks: list[int]) -> list[int]:
    """The ranks of `ranks` (a sub-world, in order) that share `rank`'s pp, dp_replicate and tp coordinates."""
    mine = dims.coords(ranks.index(rank))
    return [r for i, r in enumerate(ranks)
            if all(dims.coords(i)[a] == mine[a] for a in ("pp", "dp_replicate", "tp"))]


def test_fsdp_shards_over_dp_shard_times_cp_on_the_world_and_a_sub_world() -> None:
    dist.init_process_group("fake", rank=0, world_size=16, store=FakeStore())
    try:
        world = list(range(16))
        half = [0, 1, 2, 3, 8, 9, 10, 11]  # a sub-world, not a prefix of the rank order
        for cp, ranks in ((2, world), (2, half), (1, half)):
            dims = _dims(cp, len(ranks))
            mesh = dims.build_mesh("cpu", None if ranks == world else torch.tensor(ranks))
            assert mesh.mesh.flatten().tolist() == ranks, (cp, ranks)  # control: the layout is the rank order
            shard = fsdp_mesh(mesh, dims)
            assert shard is not None and shard.ndim == 1
            assert shard.mesh.tolist() == _shard_group(dims, 0, ranks), (cp, ranks)
            assert len(shard.mesh) == dims.fsdp_size == len(ranks) // 2  # all but tp
    finally:
        dist.destroy_process_group()
