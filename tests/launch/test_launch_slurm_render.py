"""`tessera launch slurm`: the rendered script (snapshots of a 128-node H100 run) and checks before submission."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import REPO, SlurmCluster, job_env

from framework.base.errors import ParallelismError
from framework.config import load_config
from launch.env import LaunchError
from launch.slurm import SlurmSpec, check_cluster, layout_degrees, parse_time_s, render_sbatch, validate_spec

CONFIG = "configs/pretrain/llama3-70b-128n-h100.yaml"
SNAPSHOTS = Path(__file__).parent / "snapshots"
PYTHON = "/opt/tessera/.venv/bin/python"  # stands in for sys.executable so the snapshot is machine-independent
H100 = dict(nodes=128, procs_per_node=8, gpus_per_node=8, cpus_per_rank=12, time="2-00:00:00", partition="h100",
            account="llm")


@pytest.mark.parametrize("mode", ["srun", "torchrun"])
def test_h100_128_node_script_matches_snapshot(mode: str) -> None:
    cfg = load_config(REPO / CONFIG)
    script = render_sbatch(cfg, SlurmSpec(**H100, mode=mode), CONFIG, [], python=PYTHON)  # type: ignore[arg-type]
    snapshot = SNAPSHOTS / f"llama3-70b-128n-h100.{mode}.sbatch"
    if os.environ.get("TESSERA_UPDATE_SNAPSHOTS") == "1":
        snapshot.write_text(script)
    assert script == snapshot.read_text(), f"rendered script differs from {snapshot}; review the diff, then " \
        f"rerun with TESSERA_UPDATE_SNAPSHOTS=1 if the change is intended"
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid shell
    assert "--gpus-per-node=8" in script and "--signal=USR1@300" in script and "--requeue" in script
    assert "--output=runs/llama3-70b-128n-h100/slurm-%j.out" in script and "--open-mode=append" in script
    assert "tp 8 x pp 4 x dp_replicate 1 x dp_shard 32" in script
    # a hang leaves each rank's last collectives in the run directory; each rank keeps its cores
    run_dir = "runs/llama3-70b-128n-h100"
    for line in ("export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}",
                 "export TORCH_NCCL_DUMP_ON_TIMEOUT=1",
                 f"export TORCH_NCCL_DEBUG_INFO_TEMP_FILE={run_dir}/nccl_trace/rank_",
                 f"mkdir -p {run_dir}/nccl_trace", "CPUS_PER_RANK=12", "export OMP_NUM_THREADS=$CPUS_PER_RANK"):
        assert line in script.splitlines(), line
    assert ("--cpu-bind=cores" in script) == (mode == "srun")


def test_cli_dry_run_prints_the_script_with_this_interpreter() -> None:
    args = [CONFIG, "--nodes", "128", "--gpus-per-node", "8", "--cpus-per-rank", "12", "--time", "2-00:00:00",
            "--partition", "h100", "--account", "llm", "--dry-run"]
    out = subprocess.run([sys.executable, "-m", "framework.cli", "launch", "slurm", *args], cwd=REPO,
                         env={**os.environ, **job_env()}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    expected = (SNAPSHOTS / "llama3-70b-128n-h100.srun.sbatch").read_text().replace(PYTHON, sys.executable)
    assert out.stdout == expected


def test_cpu_script_requests_no_gpus_and_passes_overrides() -> None:
    cfg = load_config(REPO / "configs/smoke/tiny.yaml", ["parallel.tp=2"])
    script = render_sbatch(cfg, SlurmSpec(nodes=2, procs_per_node=2, time="30"), "configs/smoke/tiny.yaml",
                           ["parallel.tp=2", "train.lr=1e-3"], python="python3")
    assert "gpus" not in script and "NCCL" not in script and "--exclusive" not in script
    assert "--ntasks-per-node=2" in script and "--cpus-per-task=1" in script
    assert '"$PYTHON" -m framework.cli train configs/smoke/tiny.yaml parallel.tp=2 train.lr=1e-3' in script
    assert "--partition" not in script and "--account" not in script


@pytest.mark.parametrize(("overrides", "spec", "message"), [
    (["parallel.tp=2", "parallel.dp_shard=4"], dict(nodes=2, procs_per_node=2),
     r"= 4 ranks: layout .* = 8 ranks, but the world size is 4; .*\(with 2 per node: --nodes 4\)"),
    (["parallel.tp=4", "parallel.pp=4"], dict(nodes=3, procs_per_node=8),
     r"= 24 ranks: world size 24 is not divisible by .* = 16.*\(with 8 per node: --nodes 2 or 4 or 6 or 8\)"),
    (["parallel.tp=8"], dict(nodes=1, procs_per_node=8), r"= 8 ranks: parallel.tp=8 must divide model.n_heads=4"),
])
def test_world_size_mismatch_fails_with_the_fix(overrides: list[str], spec: dict[str, int], message: str) -> None:
    cfg = load_config(REPO / "configs/smoke/tiny.yaml", overrides)
    with pytest.raises(ParallelismError, match=message):
        validate_spec(cfg, SlurmSpec(**spec))  # type: ignore[arg-type]


@pytest.mark.parametrize(("spec", "message"), [
    (dict(nodes=1, procs_per_node=4, gpus_per_node=8), "one rank drives one GPU; drop --procs-per-node or set it to 8"),
    (dict(nodes=1, procs_per_node=4, time="1:00:00:00"), "is not a SLURM time"),
    (dict(nodes=1, procs_per_node=4, time="4"), r"--signal-lead=300s must be > 0 and shorter than --time=4"),
    (dict(nodes=0, procs_per_node=4), "--nodes=0 must be >= 1"),
])
def test_bad_options_fail_with_the_fix(spec: dict[str, object], message: str) -> None:
    cfg = load_config(REPO / "configs/smoke/tiny.yaml")
    with pytest.raises(LaunchError, match=message):
        validate_spec(cfg, SlurmSpec(**spec))  # type: ignore[arg-type]


def test_layout_and_time_arithmetic() -> None:
    cfg = load_config(REPO / CONFIG)
    assert layout_degrees(cfg, 1024) == {"tp": 8, "pp": 4, "dp_replicate": 1, "dp_shard": 32}
    assert [parse_time_s(t) for t in ("90", "05:30", "04:00:00", "2-00:00:00", "1-12", "1-00:30")] == \
        [5400, 330, 14400, 172800, 129600, 88200]


def test_cli_without_ranks_per_node_names_both_flags() -> None:
    from framework.cli import main

    assert main(["launch", "slurm", "configs/smoke/tiny.yaml", "--nodes", "2", "--dry-run"]) == 2


def test_partition_checked_against_the_live_cluster(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    check_cluster(SlurmSpec(nodes=2, procs_per_node=2))  # the default partition serves
    with pytest.raises(LaunchError, match="--partition=gpu does not exist on this cluster; use one of: debug"):
        check_cluster(SlurmSpec(nodes=2, procs_per_node=2, partition="gpu"))
    slurm.run("scontrol", "update", "PartitionName=debug", "Default=NO")
    try:
        with pytest.raises(LaunchError, match="no default partition; pass --partition, one of: debug"):
            check_cluster(SlurmSpec(nodes=2, procs_per_node=2))
        check_cluster(SlurmSpec(nodes=2, procs_per_node=2, partition="debug"))
    finally:
        slurm.run("scontrol", "update", "PartitionName=debug", "Default=YES")


def test_cli_overrides_may_follow_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    from framework.cli import main

    assert main(["launch", "slurm", "configs/smoke/tiny.yaml", "train.lr=0.01", "--nodes", "2", "--procs-per-node",
                 "2", "parallel.tp=2", "--time", "30", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert "train configs/smoke/tiny.yaml train.lr=0.01 parallel.tp=2 &\n" in script
    assert "= 4 ranks = tp 2 x pp 1 x dp_replicate 1 x dp_shard 2." in script


def test_node_local_paths_warn_on_multi_node_jobs(tmp_path: Path) -> None:
    from launch.slurm import filesystem_type, node_local_paths

    mounts = "/dev/sda1 / ext4 rw 0 0\nserver:/home /shared nfs4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
    assert filesystem_type(Path("/shared/runs/x"), mounts) == "nfs4"
    assert node_local_paths({"run.dir": Path("/shared/runs/x")}, mounts) == []
    (local,) = node_local_paths({"run.dir": Path("/scratch/runs/x")}, mounts)
    assert "run.dir=/scratch/runs/x looks node-local (ext4)" in local
    (temp,) = node_local_paths({"data.cache_dir": Path("/tmp/cache")}, mounts)
    assert "a temporary directory" in temp


def test_cpus_per_rank_defaults_to_the_nodes_cores(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import launch.slurm
    from framework.cli import main

    monkeypatch.setattr(launch.slurm, "node_cpus", lambda partition: 32)
    assert main(["launch", "slurm", "configs/smoke/tiny.yaml", "--nodes", "2", "--procs-per-node", "4",
                 "--time", "30", "--dry-run", "run.dir=/tmp/x", "--stop-at", "5"]) == 0
    out = capsys.readouterr()
    assert "train configs/smoke/tiny.yaml run.dir=/tmp/x --stop-at 5" in out.out
    assert "--cpus-per-task=8" in out.out and "CPUS_PER_RANK=8" in out.out
    assert "run.dir=/tmp/x looks node-local" in out.err


def test_without_sinfo_the_job_shares_the_nodes_cores_at_start(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No `sinfo` on the submit host: not 1 core per rank, but the exclusive node's cores / ranks, at job start."""
    import launch.slurm
    from framework.cli import main

    monkeypatch.setattr(launch.slurm.shutil, "which", lambda name: None)
    assert main(["launch", "slurm", "configs/smoke/tiny.yaml", "--nodes", "1", "--procs-per-node", "4",
                 "--time", "30", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "sinfo could not tell" in out.err
    script = out.out
    assert "#SBATCH --cpus-per-task" not in script and "#SBATCH --exclusive" in script
    assert '--ntasks-per-node=4 --cpus-per-task="$CPUS_PER_RANK" --cpu-bind=cores' in script
    lines = [line for line in script.splitlines() if "CPUS_PER_RANK" in line and "srun" not in line]
    for cores, want in ((32, 8), (6, 1), (2, 1)):  # at least one core per rank
        shell = "\n".join([*lines, 'echo "$OMP_NUM_THREADS"'])
        got = subprocess.run(["bash", "-c", shell], env={**os.environ, "SLURM_CPUS_ON_NODE": str(cores)},
                             capture_output=True, text=True, check=True).stdout.split()
        assert got == [str(want)], (cores, got)


def test_a_planned_context_parallel_layout_launches_as_planned(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`tessera plan --write-config` for a long-context layout (cp > 1) gives a config `launch slurm` accepts on
    the planned nodes, with cp in the script; its data section names a placeholder build, which dry-run warns
    about and submission refuses, and a stdlib corpus on many nodes is warned about."""
    from framework.cli import main

    written = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "llama3-8b", "--gpus", "64", "--seq", "65536", "--global-batch", "64",
                 "--top", "1", "--write-config", str(written)]) == 0
    planned = capsys.readouterr().out
    # Which cp the planner ranks first moves with its memory model (CP8, then CP4 once peaks were taken at one
    # moment of the step); what must hold is that the first layout splits the sequence and launches as planned.
    top = re.search(r"\n +1 +TP(\d+) CP(\d+) PP(\d+) DP(\d+) ", planned)
    assert top, planned
    tp, cp, pp, dp = (int(g) for g in top.groups())
    assert cp > 1 and f"cp: {cp}" in written.read_text(), planned
    args = ["launch", "slurm", str(written), "--nodes", "8", "--gpus-per-node", "8", "--cpus-per-rank", "8",
            "--time", "1-00:00:00"]
    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr()
    assert f"= 64 ranks = tp {tp} x pp {pp} x dp_replicate 1 x dp_shard {dp} x cp {cp}." in out.out, out.out
    assert "data.build_dir=/shared/SET_ME/data_build holds no finished build" in out.err
    assert main(args) == 2  # submitting it: refused before sbatch, naming the directory
    assert "SET_ME/data_build/manifest.json does not exist" in capsys.readouterr().err
    assert main([*args, "--dry-run", "data.kind=stdlib"]) == 0
    assert "data.kind=stdlib: this 8-node job trains on the embedded standard-library corpus" in \
        capsys.readouterr().err
