"""Real SLURM (2 emulated nodes): the rendered sbatch script runs a 4-rank gloo job in both launch modes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import REPO, SlurmCluster, job_env

from framework.config import load_config
from launch.env import slurm_master_port
from launch.slurm import SlurmSpec, render_sbatch

FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
TINY = REPO / "configs" / "smoke" / "tiny.yaml"


def _submit_allreduce(slurm: SlurmCluster, tmp: Path, mode: str) -> tuple[str, Path]:
    cfg = load_config(TINY, [f"run.name=allreduce-{mode}", "parallel.tp=2"])
    spec = SlurmSpec(nodes=2, procs_per_node=2, time="10", signal_lead_s=60, mode=mode)  # type: ignore[arg-type]
    script = render_sbatch(cfg, spec, str(TINY), [], python=sys.executable,
                           program=[str(REPO / "tests" / "launch" / "allreduce_rank.py")])
    out = tmp / mode
    (out / "runs" / cfg.run.name).mkdir(parents=True)
    path = out / "job.sbatch"
    path.write_text(script)
    job = slurm.sbatch(path, env={**job_env(), "TESSERA_TEST_OUT": str(out)}, cwd=out)
    return job, out


@pytest.mark.slow
def test_allreduce_across_two_nodes_in_both_modes(slurm: SlurmCluster, tmp_path: Path) -> None:
    jobs = {mode: _submit_allreduce(slurm, tmp_path, mode) for mode in ("srun", "torchrun")}
    for mode, (job, out) in jobs.items():
        state = slurm.wait(job, FINAL, timeout=120)
        log = (out / "runs" / f"allreduce-{mode}" / f"slurm-{job}.out").read_text()
        assert state == "COMPLETED", f"{mode} job {job} ended {state}:\n{log}\n{slurm.logs()}"
        records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        assert [r["rank"] for r in records] == [0, 1, 2, 3]
        assert all(r["world"] == 4 and r["sum"] == 1 + 2 + 3 + 4 for r in records), records
        # Two ranks on each emulated node, each rank seeing the same rank -> host map.
        hosts = records[0]["hosts"]
        assert sorted(hosts) == ["n1", "n1", "n2", "n2"] and all(r["hosts"] == hosts for r in records)
        assert all(r["host"] == hosts[r["rank"]] for r in records)
        assert all(r["job_id"] == job for r in records)
        assert "[tessera] job " + job + " restart 0 on n[1-2]" in log
        assert "ranks exited with 0" in log
        if mode == "srun":
            assert {r["source"] for r in records} == {"slurm"}
            assert {r["master"] for r in records} == {f"n1:{slurm_master_port(job)}"}
            assert [r["local_rank"] for r in records] == [0, 1, 0, 1]
            assert [r["node_rank"] for r in records] == [0, 0, 1, 1]
        else:
            assert {r["source"] for r in records} == {"torchrun"}
            assert sorted(r["local_rank"] for r in records) == [0, 0, 1, 1]


def _submit_stand_in(slurm: SlurmCluster, tmp: Path, mode: str) -> tuple[str, Path]:
    cfg = load_config(TINY, [f"run.name=preempt-{mode}", "parallel.tp=2"])
    spec = SlurmSpec(nodes=2, procs_per_node=2, time="10", signal_lead_s=60, mode=mode)  # type: ignore[arg-type]
    script = render_sbatch(cfg, spec, str(TINY), [], python=sys.executable,
                           program=[str(REPO / "tests" / "launch" / "preempt_rank.py")])
    out = tmp / f"preempt-{mode}"
    (out / "runs" / cfg.run.name).mkdir(parents=True)
    (out / "job.sbatch").write_text(script)
    return slurm.sbatch(out / "job.sbatch", env={**job_env(), "TESSERA_TEST_OUT": str(out)}, cwd=out), out


@pytest.mark.slow
def test_usr1_requeues_and_the_restart_resumes_in_both_modes(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The script's half of preemption, with a stand-in trainer: SIGUSR1 -> exit code -> scontrol requeue ->
    restart with SLURM_RESTART_COUNT=1 -> resume. (tests/launch/test_launch_slurm_train.py does it with the
    real trainer.)"""
    jobs = {mode: _submit_stand_in(slurm, tmp_path, mode) for mode in ("srun", "torchrun")}
    signalled: dict[str, int] = {}
    deadline = time.monotonic() + 120
    while len(signalled) < len(jobs) and time.monotonic() < deadline:
        for mode, (job, out) in jobs.items():
            progress = out / "progress"
            if mode not in signalled and progress.exists() and int(progress.read_text() or 0) >= 5:
                slurm.run("scancel", "--signal=USR1", job)
                signalled[mode] = int(progress.read_text() or 0)
        time.sleep(0.2)
    assert len(signalled) == len(jobs), f"jobs never made progress: {slurm.logs()}"
    for job, _ in jobs.values():
        slurm.release_requeued(job)
    for mode, (job, out) in jobs.items():
        state = slurm.wait(job, FINAL, timeout=120)
        log = (out / "runs" / f"preempt-{mode}" / f"slurm-{job}.out").read_text()
        assert state == "COMPLETED", f"{mode} job {job} ended {state}:\n{log}\n" + slurm.logs()
        saved = int((out / "saved_step").read_text())
        assert saved >= signalled[mode]  # stopped at or after the step where the signal was sent, not before
        done = [json.loads((out / f"done{r}.json").read_text()) for r in range(4)]
        assert all(d == {"rank": r, "start": saved, "end": 80, "restart": 1, "source": done[0]["source"]}
                   for r, d in enumerate(done)), done
        assert done[0]["source"] == ("slurm" if mode == "srun" else "torchrun")
        assert "ranks exited with 42" in log and f"requeueing job {job}" in log, log
        assert f"job {job} restart 0 on" in log and f"job {job} restart 1 on" in log, log
        assert slurm.restarts(job) == 1
