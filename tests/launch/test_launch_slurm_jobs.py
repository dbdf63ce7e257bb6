"""Real SLURM (2 emulated nodes): the rendered sbatch script runs a 4-rank gloo job in both launch modes, with
the ranks placed 2 per node and launch.env reading each mode's variables. (Training, preemption and requeue with
the real trainer: test_launch_slurm_train.py.)"""

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



# (mode, signal, to the batch script?): what the sbatch script must do when `scancel --batch` signals it, and
# torchrun's agent with a step's signal (it reaches the workers too: the agent must not send it a second time).
SIGNAL_CASES = [("srun", "TERM", True), ("srun", "USR1", True), ("srun", "INT", True),
                ("torchrun", "TERM", False), ("torchrun", "INT", False), ("torchrun", "INT", True)]


@pytest.mark.slow
def test_signals_to_the_script_and_to_torchrun_reach_the_ranks_once(slurm: SlurmCluster, tmp_path: Path) -> None:
    cfg = load_config(TINY)
    jobs = {}
    for mode, sig, batch in SIGNAL_CASES:
        spec = SlurmSpec(nodes=2, procs_per_node=1, time="10", signal_lead_s=60, mode=mode)  # type: ignore[arg-type]
        script = render_sbatch(cfg, spec, str(TINY), [], python=sys.executable, degrees={"dp_shard": 2},
                               program=[str(REPO / "tests" / "launch" / "signal_rank.py")])
        out = tmp_path / f"{mode}-{sig}-{batch}"
        (out / "runs" / cfg.run.name).mkdir(parents=True)
        (out / "job.sbatch").write_text(script)
        job = slurm.sbatch(out / "job.sbatch", env=job_env(), cwd=out)
        jobs[(mode, sig, batch)] = (job, out / "runs" / cfg.run.name / f"slurm-{job}.out")

    def log(path: Path) -> str:
        return path.read_text() if path.exists() else ""

    pending = dict(jobs)
    deadline = time.monotonic() + 240
    while pending and time.monotonic() < deadline:  # signal each job once both ranks are in their loop
        for key, (job, path) in list(pending.items()):
            if "start 0" in log(path) and "start 1" in log(path):
                slurm.run("scancel", *(["--batch"] if key[2] else []), f"--signal={key[1]}", job)
                del pending[key]
        time.sleep(0.3)
    assert not pending, f"ranks never started: {pending}\n{slurm.logs()}"
    for (_mode, sig, batch), (job, path) in jobs.items():
        if sig == "INT":
            assert slurm.wait(job, FINAL, timeout=120) == "FAILED", log(path)
            assert "ranks exited with 130" in log(path) and slurm.restarts(job) == 0, log(path)
        else:
            assert slurm.wait(job, ("PENDING",), timeout=120) == "PENDING" and slurm.restarts(job) == 1, log(path)
            assert "ranks exited with 42" in log(path) and f"requeueing job {job}" in log(path), log(path)
            slurm.run("scancel", job)  # held by SLURM's requeue BeginTime: never starts again
        assert "second SIGINT" not in log(path) and "Traceback" not in log(path), log(path)
        if batch:
            assert f"batch script got SIG{sig}: forwarding it to the ranks" in log(path), log(path)
