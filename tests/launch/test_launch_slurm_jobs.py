"""Real SLURM (2 emulated nodes): the rendered sbatch script runs a 4-rank gloo job in both launch modes, with
the ranks placed 2 per node and launch.env reading each mode's variables. (Training, preemption and requeue with
the real trainer: test_launch_slurm_train.py.)"""

from __future__ import annotations

import json
import sys
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

