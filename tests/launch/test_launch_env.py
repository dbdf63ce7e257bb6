"""launch.env.dist_env: pure tests over hand-written environments (real SLURM/torchrun runs are in test_slurm*)."""

from __future__ import annotations

import re

import pytest

from framework.base.errors import TesseraError
from launch.env import (
    DistEnv,
    LaunchError,
    cuda_device_index,
    dist_env,
    expand_hostlist,
    expand_tasks_per_node,
    slurm_master_port,
)


def _no_scontrol(nodelist: str) -> list[str]:
    return expand_hostlist(nodelist)


def _slurm(**extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
           "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]"}
    env.update(extra)
    return env


def test_single_process_defaults() -> None:
    env = dist_env({})
    assert env == DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                          master_addr="127.0.0.1", master_port=29500, source="single")
    assert not env.is_distributed


def test_torchrun_environment() -> None:
    env = dist_env({"TORCHELASTIC_RUN_ID": "abc", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                    "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29400",
                    "TORCHELASTIC_RESTART_COUNT": "2"})
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                          master_addr="node7", master_port=29400, source="torchrun", job_id="abc",
                          restart_count=2, elastic_restart_count=2)


def test_torchrun_inside_slurm_takes_torchrun_ranks_and_slurm_restarts() -> None:
    # srun torchrun: SLURM_PROCID numbers the agents (0..nnodes-1); the training rank is torchrun's.
    env = dist_env({**_slurm(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_RESTART_COUNT="1"),
                    "TORCHELASTIC_RUN_ID": "4711", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                    "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "n2", "MASTER_PORT": "29400"},
                   hostnames=_no_scontrol)
    assert (env.source, env.rank, env.world_size, env.node_rank) == ("torchrun", 0, 4, 0)
    assert (env.job_id, env.restart_count, env.elastic_restart_count) == ("4711", 1, 0)


def test_slurm_environment() -> None:
    env = dist_env(_slurm(SLURM_RESTART_COUNT="2"), hostnames=_no_scontrol)
    assert env == DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                          master_addr="n1", master_port=slurm_master_port("4711"), source="slurm",
                          job_id="4711", restart_count=2)
    assert env.master_port == 20000 + 4711


def test_slurm_uneven_tasks_per_node_and_explicit_master() -> None:
    env = dist_env(_slurm(SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5", SLURM_PROCID="4", SLURM_LOCALID="0",
                          SLURM_NODEID="2", SLURM_STEP_TASKS_PER_NODE="2(x2),1", MASTER_ADDR="10.0.0.1",
                          MASTER_PORT="1234"), hostnames=_no_scontrol)
    assert (env.local_world_size, env.master_addr, env.master_port) == (1, "10.0.0.1", 1234)


def test_batch_shell_without_step_is_single() -> None:
    # The sbatch shell has SLURM_PROCID=0 but no step id: it is not a rank of the training job.
    env = {k: v for k, v in _slurm(SLURM_PROCID="0").items() if k != "SLURM_STEP_ID"}
    got = dist_env(env, hostnames=_no_scontrol)
    assert (got.source, got.world_size, got.job_id) == ("single", 1, "4711")


@pytest.mark.parametrize(("extra", "message"), [
    ({"RANK": "0"}, "RANK=0 disagrees with SLURM_PROCID=3"),
    ({"WORLD_SIZE": "8"}, "WORLD_SIZE=8 disagrees with SLURM_NTASKS=4"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 disagrees with SLURM_LOCALID=1"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 must be in [0, SLURM_NTASKS=4)"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 must be in [0, tasks on this node=2)"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, "sum to 6 but SLURM_NTASKS=4"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2x2"}, "malformed"),
    ({"SLURM_NTASKS": "four", "SLURM_STEP_NUM_TASKS": ""}, "SLURM_NTASKS='four' is not an integer"),
])
def test_slurm_disagreements_raise(extra: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        dist_env(_slurm(**extra), hostnames=_no_scontrol)


def test_slurm_missing_nodelist_names_the_fix() -> None:
    env = {k: v for k, v in _slurm().items() if "NODELIST" not in k}
    with pytest.raises(LaunchError, match="export MASTER_ADDR"):
        dist_env(env, hostnames=_no_scontrol)


@pytest.mark.parametrize(("extra", "message"), [
    ({"RANK": "4"}, r"RANK=4 must be in \[0, WORLD_SIZE=4\)"),
    ({"LOCAL_WORLD_SIZE": "8"}, "need 1 <= LOCAL_WORLD_SIZE <= WORLD_SIZE"),
    ({"LOCAL_RANK": "2"}, r"LOCAL_RANK=2 must be in \[0, LOCAL_WORLD_SIZE=2\)"),
])
def test_torchrun_inconsistencies_raise(extra: dict[str, str], message: str) -> None:
    base = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(LaunchError, match=message):
        dist_env({**base, **extra})
    assert issubclass(LaunchError, TesseraError)


def test_export_round_trips_through_torchrun_reader() -> None:
    env = dist_env(_slurm(), hostnames=_no_scontrol)
    out: dict[str, str] = {}
    env.export(out)
    back = dist_env({**out, "TORCHELASTIC_RUN_ID": "r"})
    assert (back.rank, back.world_size, back.local_rank, back.master_addr, back.master_port) == \
        (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port)


@pytest.mark.parametrize(("spec", "hosts"), [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[008-010],login1", ["gpu008", "gpu009", "gpu010", "login1"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("a[1,3-4],b", ["a1", "a3", "a4", "b"]),
])
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


def test_expand_tasks_per_node_and_ports() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    assert slurm_master_port("1234_7") == 20000 + 12347 % 10000
    assert 20000 <= slurm_master_port("987654321") < 30000


@pytest.mark.parametrize(("local_rank", "local_world", "count", "visible", "want"), [
    (3, 8, 8, None, 3),            # every GPU visible: local rank i drives GPU i
    (3, 8, 8, "0,1,2,3,4,5,6,7", 3),
    (5, 8, 1, "5", 0),             # the site binds one GPU per task: each rank sees its own as device 0
    (1, 2, 4, None, 1),            # more GPUs than ranks
])
def test_cuda_device_index(local_rank: int, local_world: int, count: int, visible: str | None, want: int) -> None:
    assert cuda_device_index(local_rank, local_world, count, visible) == want == local_rank % count


@pytest.mark.parametrize(("local_rank", "local_world", "count", "visible", "message"), [
    (5, 8, 4, "0,1,2,3", "8 ranks on this node but 4 GPU(s) visible to LOCAL_RANK=5"),
    (1, 2, 1, None, "two ranks would share a GPU"),  # one GPU, no per-task binding
    (0, 1, 0, "", "sees no CUDA device"),
])
def test_cuda_device_index_refuses_shared_gpus(local_rank: int, local_world: int, count: int, visible: str | None,
                                               message: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(message)):
        cuda_device_index(local_rank, local_world, count, visible)


def test_init_distributed_binds_the_rank_and_passes_device_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake CUDA (torch.cuda and init_process_group monkeypatched): nothing else reaches the NCCL branch on CPU.

    Rank 11 of 16, local rank 3 of 8, on a node whose 8 GPUs are all visible: GPU 3 is selected before the
    process group exists and handed to it as device_id."""
    import torch
    import torch.distributed as dist

    from framework.cli import init_distributed

    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    env = {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29500"}
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    init_distributed(60)
    assert calls["backend"] == "nccl" and calls["rank"] == 11 and calls["world_size"] == 16
    assert calls["set_device"] == torch.device("cuda", 3) == calls["device_id"]
