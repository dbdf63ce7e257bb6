"""bench/gpu_check.sh end to end in its CPU dry mode (tiny shapes, fp32, aot_eager): every phase reports, the
JSON is complete after the run, and the planner reads the calibration it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.errors import ConfigError
from framework.plan.hardware import load_calibration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_phase(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh"), "--dry"], env=env, capture_output=True,
                          text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["meta"]["dry"] and report["meta"]["backend"] == "aot_eager"
    assert len(report["parity"]) == 4 and all(row["ok"] for row in report["parity"]), report["parity"]
    runs = [row for row in report["throughput"] if "skipped" not in row]
    assert {(r["model"], r["compiled"]) for r in runs} == {("tiny", False), ("tiny", True)}
    assert all(r["tokens_per_s"] > 0 and r["planner_peak_gib"] > 0 for r in runs)
    calib = json.loads((tmp_path / "gpu_calibration.json").read_text())
    assert report["calibration"] == calib and 0 < calib["mm_efficiency"] <= 1
    assert load_calibration(str(tmp_path / "gpu_calibration.json"), "cpu") == {
        "mm_efficiency": str(calib["mm_efficiency"])}


def test_planner_rejects_a_calibration_of_another_gpu(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"gpu": "h100-80g", "mm_efficiency": 0.5}))
    assert load_calibration(str(path), "h100-80g") == {"mm_efficiency": "0.5"}
    with pytest.raises(ConfigError, match="measured gpu='h100-80g', but --gpu h200"):
        load_calibration(str(path), "h200")
    path.write_text(json.dumps({"gpu": "h200", "mm_efficiency": 1.7}))
    with pytest.raises(ConfigError, match=r"must be a number in \(0, 1\]"):
        load_calibration(str(path), "h200")
