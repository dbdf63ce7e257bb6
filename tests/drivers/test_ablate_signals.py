"""`timeout -s TERM` around `tessera ablate`: the run in flight commits its checkpoint and the driver exits with the
requeue code instead of starting the next run; the rerun skips the finished runs and resumes the stopped one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.checkpoint import REQUEUE_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]


def _losses(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if r.get("type") == "train"]


@pytest.mark.slow
def test_sigterm_stops_the_ablation_and_a_rerun_continues(  # type: ignore[no-untyped-def]
        stdlib_build, tmp_path: Path) -> None:
    spec = tmp_path / "mix.ablate.yaml"
    spec.write_text(json.dumps({
        "name": "sig", "config": str(REPO / "configs/ablations/tiny-stdlib.yaml"),
        "sources": ["code", "prose", "tests"],
        "mixtures": {"explicit": [{"code": 1, "prose": 1, "tests": 1}, {"code": 0.6, "prose": 0.2, "tests": 0.2},
                                  {"code": 0.2, "prose": 0.6, "tests": 0.2}]},
        "token_budget": 8 * 64 * 12, "seeds": [0], "evals_per_run": 2}))
    out = tmp_path / "abl"
    argv = [sys.executable, "-m", "framework.cli", "ablate", str(spec), "--out", str(out),
            "--set", f"data.cache_dir={stdlib_build.cfg.cache_dir}", "--set", "train.eval_batches=2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TESSERA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "first.log").open("wb")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    second = out / "runs" / "m01-s0"
    deadline = time.monotonic() + 600
    while len(_losses(second)) < 3:  # the second run is 3 steps in
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.05)
    seen = max(_losses(second))
    proc.send_signal(signal.SIGTERM)  # what `timeout -s TERM` and SLURM do
    assert proc.wait(timeout=120) == REQUEUE_EXIT_CODE, (tmp_path / "first.log").read_text()[-3000:]
    stopped = int((second / "checkpoints/latest").read_text().strip().removeprefix("step_"))
    assert seen <= stopped <= seen + 2 and max(_losses(second)) == stopped  # within one step, plus its save
    assert not (out / "runs" / "m02-s0").exists()  # the driver did not move on
    first_mtime = (out / "runs/m00-s0/metrics.jsonl").stat().st_mtime_ns

    rerun = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert (out / "runs/m00-s0/metrics.jsonl").stat().st_mtime_ns == first_mtime  # finished: not redone
    assert f"resumed from step_{stopped}" in (second / "train.log").read_text()
    assert all((out / "runs" / f"m0{i}-s0" / "result.json").is_file() for i in range(3))
