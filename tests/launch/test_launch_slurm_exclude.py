"""Exclude and requeue, with the real trainer on the real 2-node SLURM (tests/launch/slurm_cluster.py).

`tessera launch slurm configs/smoke/tiny.yaml --nodes 2 --procs-per-node 2` (ZeRO-1 data parallel, dp_shard
inferred) with observe.exclude on, shrink on (this cluster has no spare node), and rank 2 slowed in its optimizer
step (observe.straggler.inject); srun puts ranks 2 and 3 on n2. The straggler detector names rank 2 after 3
windows of 2 steps; the policy writes n2 with its evidence into runs/tiny/exclude.json, every rank commits a
checkpoint and exits with the requeue code, and the script requeues the job with ExcNodeList=n2 and one node. The
job restarts on n1 alone (2 ranks) and resumes from that checkpoint. The reference runs side by side: `tessera
launch local --nproc 2`, the remaining node's world, uninterrupted. Every step's loss must match it — the steps
before the exclusion computed the same global batches on 4 ranks, the rest on the 2 ranks of n1.
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
from slurm_cluster import REPO, SlurmCluster, job_env

CONFIG = REPO / "configs" / "smoke" / "tiny.yaml"
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
STEPS = 12
# Windows of 2 steps; the detector names a rank after 3 slow windows (observe.straggler.persist), the policy
# confirms it at the same count (observe.exclude.windows). The first window holds the warm-up step.
RUN = [f"train.steps={STEPS}", "checkpoint.interval=0", "observe.straggler.interval=2",
       "observe.straggler.inject=2:optimizer:0.2", "observe.exclude.enabled=true", "observe.exclude.shrink=true"]


def _env(slurm: SlurmCluster) -> dict[str, str]:
    return {**slurm.env, **job_env(), "OMP_NUM_THREADS": "1", "TESSERA_NUM_THREADS": "1"}


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["step"]: r["loss"] for r in records if r.get("type") == "train"}


def _requeue_applied(run_dir: Path) -> bool:
    path = run_dir / "exclude.json"
    return path.is_file() and any(h["action"] == "requeue" for h in json.loads(path.read_text())["history"])


def _wait_for(what: str, ready: object, slurm: SlurmCluster, job: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        if slurm.job_state(job) in FINAL:
            pytest.fail(f"job {job} ended ({slurm.job_state(job)}) before {what}:\n{slurm.logs()}")
        time.sleep(0.3)
    pytest.fail(f"no {what} in {timeout} s:\n{slurm.logs()}")


@pytest.mark.slow
def test_bad_node_is_excluded_from_the_requeued_job_and_the_run_matches_the_remaining_node(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    local_dir, slurm_dir = tmp_path / "local", tmp_path / "slurm"
    local_dir.mkdir()
    slurm_dir.mkdir()
    local = subprocess.Popen([sys.executable, "-m", "framework.cli", "launch", "local", "--nproc", "2", str(CONFIG),
                              *RUN], cwd=local_dir, env=_env(slurm), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out = subprocess.run([sys.executable, "-m", "framework.cli", "launch", "slurm", str(CONFIG), "--nodes", "2",
                          "--procs-per-node", "2", "--time", "10", "--signal-lead", "60", *RUN], cwd=slurm_dir,
                         env=_env(slurm), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    job, run_dir = out.stdout.split()[-1], slurm_dir / "runs" / "tiny"

    # The run names n2, commits a checkpoint, exits 42; the script requeues with the exclusion; then start it now.
    _wait_for("requeue with the exclusion", lambda: _requeue_applied(run_dir), slurm, job)
    slurm.release_requeued(job)
    state = slurm.wait(job, FINAL, timeout=400)
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{log}\n{slurm.logs()}"

    # The decision and its evidence: node n2, from the straggler verdict on rank 2's optimizer section.
    record = json.loads((run_dir / "exclude.json").read_text())
    entry = record["nodes"]["n2"]
    assert list(record["nodes"]) == ["n2"] and entry["reason"] == "straggler" and entry["by"] == "policy", record
    assert entry["evidence"]["rank"] == 2 and entry["evidence"]["section"] == "optimizer", entry
    assert entry["evidence"]["slowdown"] >= 1.5 and entry["evidence"]["windows"] >= 3, entry
    applied = [h for h in record["history"] if h["action"] == "requeue"]
    assert len(applied) == 1 and applied[0]["ok"] and applied[0]["nodes"] == ["n2"], record["history"]

    # SLURM excluded it: the requeued job ran on n1 alone, with 2 tasks.
    shown = slurm.run("scontrol", "show", "job", job)
    assert re.search(r"\bExcNodeList=n2\b", shown) and re.search(r"\bNodeList=n1\b", shown), shown
    assert "NumNodes=1 " in shown and "NumTasks=2 " in shown and slurm.restarts(job) == 1, shown
    assert f"job {job} restart 0 on n[1-2]" in log and f"job {job} restart 1 on n1 " in log, log
    assert "excluding n2 (policy: straggler at step" in log, log
    assert "ExcNodeList=n2 NumNodes=1-1 NumTasks=2 NumCPUs=8: ok" in log, log
    resumed = re.search(r"resumed from step_(\d+)", log)
    assert resumed is not None and int(resumed.group(1)) == entry["step"] < STEPS, (entry, log)
    assert f"training tiny from step {entry['step']} to {STEPS} on 2 rank(s)" in log, log

    local_out, _ = local.communicate(timeout=600)
    assert local.returncode == 0, local_out
    reference, losses = _losses(local_dir / "runs" / "tiny"), _losses(run_dir)
    assert sorted(reference) == sorted(losses) == list(range(1, STEPS + 1)), (sorted(losses), log)
    got = torch.tensor([losses[s] for s in sorted(losses)], dtype=torch.float64)
    want = torch.tensor([reference[s] for s in sorted(reference)], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"exclude-and-requeue vs the remaining node:\n{got}\n{want}"
