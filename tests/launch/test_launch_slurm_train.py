"""SLURM operations proven with the real trainer on the real 2-node SLURM.

One test, so its runs go side by side: `tessera launch local --nproc 4 configs/smoke/tiny-tp2dp2.yaml` (the
uninterrupted reference) and `tessera launch slurm configs/smoke/tiny-tp2dp2.yaml --nodes 2 --procs-per-node 2`
(TP2 x DP2 over gloo, 2 ranks on each emulated node) in both modes, srun of ranks and srun of torchrun. Each SLURM
job gets `scancel --signal=USR1` mid-run: the trainer saves and exits with the requeue code, the script runs
`scontrol requeue`, the job restarts (SLURM_RESTART_COUNT=1) and resumes from the checkpoint. Its metrics then
hold every step once — the steps before the signal from the first start, the rest from the resumed one — and
every step's loss must match the local run's: the launch parity and the resume parity in one comparison, at
half the CPU of a separate uninterrupted SLURM job (the CI budget is ~3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm_cluster import CPUS_PER_NODE, REPO, SlurmCluster, job_env

from framework.config import load_config

CONFIG = REPO / "configs" / "smoke" / "tiny-tp2dp2.yaml"
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
SIGNAL_AT_STEP = 3
LOCAL_LAUNCH = ["framework.cli", "launch", "local", "--nproc", "4"]


def _env(slurm: SlurmCluster) -> dict[str, str]:
    return {**slurm.env, **job_env(), "OMP_NUM_THREADS": "1", "TESSERA_NUM_THREADS": "1"}


def _submit(slurm: SlurmCluster, cwd: Path, mode: str) -> str:
    """`tessera launch slurm` for real (no --dry-run): it checks the cluster, sbatches, prints the job id."""
    cwd.mkdir(parents=True)
    cmd = [sys.executable, "-m", "framework.cli", "launch", "slurm", str(CONFIG), "--nodes", "2",
           "--procs-per-node", "2", "--time", "10", "--signal-lead", "60", "--mode", mode]
    out = subprocess.run(cmd, cwd=cwd, env=_env(slurm), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    # The run directory is under pytest's /tmp: a 2-node job is warned (this cluster's nodes share it).
    assert f"run.dir={cwd}/runs/tiny-tp2dp2 looks node-local (a temporary directory" in out.stderr, out.stderr
    job = out.stdout.split()[-1]
    # No --cpus-per-rank: the default is the node's cores (sinfo: CPUS_PER_NODE) over the ranks per node.
    per_rank = CPUS_PER_NODE // 2
    want = per_rank if mode == "srun" else 2 * per_rank  # torchrun: one task per node holds both ranks
    assert f"CPUs/Task={want}" in slurm.run("scontrol", "show", "job", job), slurm.run("scontrol", "show", "job", job)
    return job


def _train_losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["step"]: r["loss"] for r in records if r.get("type") == "train"}


def _signal_mid_run(slurm: SlurmCluster, jobs: dict[str, tuple[str, Path]], timeout: float = 400) -> dict[str, int]:
    """USR1 to each job once its metrics show step >= SIGNAL_AT_STEP; returns the step seen at signal time."""
    signalled: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while len(signalled) < len(jobs) and time.monotonic() < deadline:
        for name, (job, run_dir) in jobs.items():
            steps = _train_losses(run_dir)
            if name not in signalled and steps and max(steps) >= SIGNAL_AT_STEP:
                slurm.run("scancel", "--signal=USR1", job)
                signalled[name] = max(steps)
            elif name not in signalled and slurm.job_state(job) in FINAL:
                pytest.fail(f"{name} job {job} ended before the signal:\n{slurm.logs()}")
        time.sleep(0.2)
    assert len(signalled) == len(jobs), f"no training progress in {timeout} s:\n{slurm.logs()}"
    return signalled


@pytest.mark.slow
def test_slurm_training_matches_local_and_resumes_after_usr1(slurm: SlurmCluster, tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    steps, run = cfg.train.steps, f"runs/{cfg.run.name}"
    local_dir = tmp_path / "local"
    local_dir.mkdir()
    local = subprocess.Popen([sys.executable, "-m", *LOCAL_LAUNCH, str(CONFIG)], cwd=local_dir, env=_env(slurm),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    jobs = {mode: (_submit(slurm, tmp_path / mode, mode), tmp_path / mode / run) for mode in ("srun", "torchrun")}
    signalled = _signal_mid_run(slurm, jobs)
    for job, _ in jobs.values():
        slurm.release_requeued(job)
    local_out, _ = local.communicate(timeout=600)
    assert local.returncode == 0, local_out
    reference = _train_losses(local_dir / run)
    assert sorted(reference) == list(range(1, steps + 1)), local_out

    for name, (job, run_dir) in jobs.items():
        state = slurm.wait(job, FINAL, timeout=400)
        log = (run_dir / f"slurm-{job}.out").read_text()
        assert state == "COMPLETED", f"{name} job {job} ended {state}:\n{log}\n{slurm.logs()}"
        losses = _train_losses(run_dir)
        assert sorted(losses) == sorted(reference), f"{name}: steps {sorted(losses)}\n{log}"
        got = torch.tensor([losses[s] for s in sorted(losses)], dtype=torch.float64)
        want = torch.tensor([reference[s] for s in sorted(reference)], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), f"{name} vs launch local:\n{got}\n{want}\n{log}"
        assert slurm.restarts(job) == 1
        assert "ranks exited with 42" in log and f"requeueing job {job}" in log, log
        assert f"job {job} restart 0 on" in log and f"job {job} restart 1 on" in log, log
        resumed = re.search(r"resumed from step_(\d+)", log)
        assert resumed is not None, log
        # The save came from the signal: the resume point is at or after the step seen when it was sent.
        assert signalled[name] <= int(resumed.group(1)) < steps, (signalled[name], resumed.group(0))
