"""ParallelDims: the rank layout as a pure function (golden tables up to 4,096 ranks), validation before any
process group, agreement with torch's own `init_device_mesh` on the fake backend at 1,024 ranks, and layouts
packed side by side creating the same process groups on every rank (fake backend)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from framework.base.errors import ConfigError, ParallelismError
from framework.parallel.config import ParallelConfig
from framework.parallel.mesh import AXES, ParallelDims, groups_created, stage_layers
from framework.parallel.pipeline_schedules import stages_of_rank
from models.config import model_config

BIG = ParallelDims(pp=8, dp_replicate=4, dp_shard=16, cp=1, tp=8, ep=32)  # 4,096 ranks


def test_golden_coords_at_4096() -> None:
    assert BIG.world_size == 4096
    assert BIG.coords(0) == dict.fromkeys(AXES, 0)
    assert BIG.coords(4095) == {"pp": 7, "dp_replicate": 3, "dp_shard": 15, "cp": 0, "tp": 7}
    # 1234 = 2*512 + 1*128 + 10*8 + 2
    assert BIG.coords(1234) == {"pp": 2, "dp_replicate": 1, "dp_shard": 10, "cp": 0, "tp": 2}
    assert BIG.rank_of(pp=2, dp_replicate=1, dp_shard=10, tp=2) == 1234
    assert BIG.dp_rank(1234) == 1 * 16 + 10
    assert all(BIG.rank_of(**BIG.coords(r)) == r for r in range(0, 4096, 7))


def test_golden_groups_at_4096() -> None:
    assert BIG.group_of(1234, "tp") == list(range(1232, 1240))
    assert BIG.group_of(1234, "pp") == [210, 722, 1234, 1746, 2258, 2770, 3282, 3794]
    assert BIG.group_of(1234, "dp_shard") == list(range(1154, 1154 + 16 * 8, 8))
    dp = BIG.group_of(1234, ("dp_replicate", "dp_shard"))
    assert dp == sorted(1024 + 2 + 128 * r + 8 * s for r in range(4) for s in range(16))
    for axes, n_groups in (("tp", 512), ("pp", 512), ("dp_shard", 256), (("dp_replicate", "dp_shard"), 64)):
        groups = BIG.groups(axes)
        assert len(groups) == n_groups
        assert sorted(r for g in groups for r in g) == list(range(4096))  # a partition of the world


def test_golden_expert_groups_at_4096() -> None:
    # ep=32 blocks of the 128 (dp_shard x tp) ranks of one (pp, dp_replicate) slice; 1234 sits at offset 82.
    ep = [g for g in BIG.ep_groups() if 1234 in g]
    assert ep == [list(range(1216, 1248))]
    edp = [g for g in BIG.edp_groups() if 1234 in g]
    assert edp == [sorted(1024 + 128 * r + 32 * b + 18 for r in range(4) for b in range(4))]
    assert BIG.edp_size == 16 and len(BIG.ep_groups()) == 128 and len(BIG.edp_groups()) == 8 * 32


def test_dp_shard_inferred_and_world_mismatch() -> None:
    cfg = ParallelConfig(tp=2, pp=2)
    assert ParallelDims.from_config(cfg, 8).dp_shard == 2
    with pytest.raises(ParallelismError, match="world size 6 is not divisible"):
        ParallelDims.from_config(cfg, 6)
    with pytest.raises(ParallelismError, match="but the world size is 16"):
        ParallelDims.from_config(ParallelConfig(tp=2, pp=2, dp_shard=2), 16)


@pytest.mark.parametrize(("overrides", "world", "match"), [
    ({"tp": 3}, 3, "must divide model.n_heads=4"),
    ({"pp": 8, "dp_shard": 1}, 8, "larger than model.n_layers=4"),
    ({"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_virtual_stages": 3}, 2, "do not divide model.n_layers=4"),
    ({"pp": 2, "pp_layer_split": [1, 2]}, 2, "must have pp x virtual stages"),
    ({"ep": 2}, 2, "needs a mixture-of-experts model"),
    ({"zero_stage": 0}, 2, "zero_stage=0"),
    ({"cpu_offload": True, "dp_shard": 1}, 1, "cpu_offload"),
])
def test_bad_layouts_raise_before_any_process_group(overrides: dict, world: int, match: str) -> None:
    model = model_config("test-tiny")
    with pytest.raises(ParallelismError, match=match):
        ParallelDims.from_config(ParallelConfig(**overrides), world, model)
    assert not dist.is_initialized()


def test_tp_shards_or_replicates_kv_heads() -> None:
    """tp must divide n_kv_heads (shard) or be a multiple of it (replicate, as Megatron-LM); else refused."""
    tiny = model_config("test-tiny")  # 4 heads, 2 KV heads
    assert ParallelDims.from_config(ParallelConfig(tp=4), 4, tiny).tp == 4  # each KV head on 2 tp ranks
    odd = dataclasses.replace(tiny, hidden=96, n_heads=12, n_kv_heads=4, ffn_hidden=192, vocab_size=576)
    with pytest.raises(ParallelismError, match=r"parallel.tp=6 and model.n_kv_heads=4.*valid tp .*\[1, 2, 4, 12\]"):
        ParallelDims.from_config(ParallelConfig(tp=6), 6, odd)


def test_expert_constraints() -> None:
    moe = model_config("test-moe")  # 4 experts
    with pytest.raises(ParallelismError, match="must divide dp_shard x cp x tp = 2"):
        ParallelDims.from_config(ParallelConfig(ep=4, dp_shard=2), 2, moe)
    with pytest.raises(ParallelismError, match=r"must divide model\.moe\.n_experts=4"):
        ParallelDims.from_config(ParallelConfig(ep=3, dp_shard=3), 3, moe)
    dims = ParallelDims.from_config(ParallelConfig(ep=4, tp=2), 4, moe)
    assert dims.ep_groups() == [[0, 1, 2, 3]] and dims.edp_groups() == [[0], [1], [2], [3]]


def test_config_rejects_bad_schedule_and_virtual_stages() -> None:
    with pytest.raises(ConfigError, match="did you mean 1F1B"):
        ParallelConfig(pp_schedule="1f1b").validate()
    with pytest.raises(ConfigError, match="exactly 2 stages"):
        ParallelConfig(pp_schedule="ZBVZeroBubble", pp_virtual_stages=3).validate()
    assert ParallelConfig(pp_schedule="Interleaved1F1B").virtual_stages == 2


def test_sequence_parallel_needs_seq_len_divisible_by_tp() -> None:
    from pathlib import Path

    from framework.config import load_config

    tiny = Path(__file__).resolve().parents[2] / "configs/smoke/tiny.yaml"
    with pytest.raises(ParallelismError, match=r"data.seq_len=33 must be divisible by parallel.tp=2.*32 or 34"):
        load_config(tiny, ["parallel.tp=2", "data.seq_len=33"])
    no_sp = load_config(tiny, ["parallel.tp=2", "data.seq_len=33", "parallel.sequence_parallel=false"])
    assert no_sp.data.seq_len == 33


def test_micro_batches_fit_the_schedule_before_launch() -> None:
    from framework.train.config import TrainConfig
    from framework.train.parallel_engine import micro_batches

    dims = ParallelDims(pp=4, dp_replicate=1, dp_shard=1, cp=1, tp=1)
    train = TrainConfig(global_batch_size=9, micro_batch_size=1)
    with pytest.raises(ParallelismError, match=r"9 / \(1 x 1\) = 9.*nearest that fit are 8 and 10"):
        micro_batches(dims, train, "Interleaved1F1B")
    assert micro_batches(dims, train, "1F1B") == 9
    six = TrainConfig(global_batch_size=6, micro_batch_size=1)
    assert micro_batches(dims, six, "Interleaved1F1B") == 6  # one round of 6: torch accepts it
    with pytest.raises(ParallelismError, match=r"DualPipeV needs at least 2 x parallel.pp .* = 8"):
        micro_batches(dims, six, "DualPipeV")
    with pytest.raises(ParallelismError, match=r"1F1B needs at least parallel.pp = 4"):
        micro_batches(dims, TrainConfig(global_batch_size=3, micro_batch_size=1), "1F1B")
    # the smallest pipeline is checked too (torch refuses DualPipeV with 3 micro-batches on 2 ranks); without one,
    # a single micro-batch is every layout's
    two = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=1)
    three = TrainConfig(global_batch_size=3, micro_batch_size=1)
    with pytest.raises(ParallelismError, match=r"DualPipeV needs at least 2 x parallel.pp .* = 4"):
        micro_batches(two, three, "DualPipeV")
    assert micro_batches(ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1), three, "DualPipeV") == 3
    # global batch / (micro-batch x data ranks): 32 rows over 2 x 2 data ranks in micro-batches of 2 is 4 each
    hsdp = ParallelDims(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1)
    assert micro_batches(hsdp, TrainConfig(global_batch_size=32, micro_batch_size=2)) == 4


def test_stage_split_and_placement() -> None:
    assert stage_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(5, 2, [1, 4]) == [[0], [1, 2, 3, 4]]
    assert stages_of_rank(1, 4, 2, "Interleaved1F1B") == [1, 5]
    assert stages_of_rank(1, 4, 2, "ZBVZeroBubble") == [1, 6]


def test_fake_backend_device_mesh_matches_pure_layout_at_1024() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims(pp=4, dp_replicate=2, dp_shard=16, cp=1, tp=8)
    rank = 777
    dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    try:
        mesh = dims.build_mesh("cpu")
        for axis in AXES:
            assert sorted(mesh[axis].mesh.flatten().tolist()) == dims.group_of(rank, axis), axis
        dp = mesh["dp_replicate", "dp_shard"].mesh.flatten().tolist()
        assert sorted(dp) == dims.group_of(rank, ("dp_replicate", "dp_shard"))
        assert list(mesh.get_coordinate() or ()) == [dims.coords(rank)[a] for a in AXES]
    finally:
        dist.destroy_process_group()


def test_packed_moe_layouts_give_each_group_name_one_rank_set() -> None:
    """Two MoE layouts side by side on 4 ranks (0-1: dp_shard 2 x ep 2; 2-3: tp 2), as the parity tests pack
    them. torch names a process group by a per-process counter and its ranks rendezvous under that name, so a
    name must mean one rank set on every rank: the expert meshes come with `build_mesh(experts=True)`, which
    every rank calls, and the engine's `build_ep_mesh` only looks its own up. Built by each layout's own ranks
    (as an older build_mesh did) both layouts' expert groups get the same names: the spawn that held them
    deadlocked. A sub-world mesh built without its expert mesh refuses to create one on its ranks alone."""
    from parallel_parity import group_members, group_name_conflicts
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layouts = [ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2),
               ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2)]
    groups: dict[str, list[dict[str, tuple[int, ...]]]] = {"with build_mesh": [], "by their own ranks": []}
    for rank in range(4):
        mine = rank // 2
        for way, out in groups.items():
            dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
            try:
                meshes = [d.build_mesh("cpu", torch.arange(2 * i, 2 * i + 2), experts=way == "with build_mesh")
                          for i, d in enumerate(layouts)]
                before = groups_created()
                if way == "with build_mesh":
                    ep = layouts[mine].build_ep_mesh(meshes[mine])
                    assert ep is layouts[mine].build_ep_mesh(meshes[mine]) and groups_created() == before
                    assert ep["ep"].mesh.tolist() == ([0, 1] if mine == 0 else [rank])
                else:
                    with pytest.raises(ParallelismError, match=r"sub-world mesh \(2 of 4 ranks\).*experts=True"):
                        layouts[mine].build_ep_mesh(meshes[mine])
                    layouts[mine]._build_expert_mesh(meshes[mine])  # what MoEParallel did before the fix
                out.append(group_members())
            finally:
                dist.destroy_process_group()
    assert group_name_conflicts(groups["with build_mesh"]) == {}
    assert group_name_conflicts(groups["by their own ranks"])  # the check above can fail
