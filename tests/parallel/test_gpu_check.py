"""bench/gpu_check.sh end to end in its CPU dry mode (tiny shapes, fp32, aot_eager): every phase reports, the
JSON is complete after the run, its FLOP convention (Tessera's rows and the plain reference's) is the planner's,
and the planner reads the calibration it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.base.errors import ConfigError
from framework.plan.hardware import load_calibration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_phase(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh"), "--dry"], env=env, capture_output=True,
                          text=True, timeout=660)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["meta"]["dry"] and report["meta"]["backend"] == "aot_eager"
    phases = ("attention", "kernels", "checkpoint", "parity", "throughput", "slice")
    skipped = [row for phase in phases for row in report[phase] if "skipped" in row or "error" in row]
    assert not skipped, f"phases skipped or failed ({report['meta']['elapsed_s']} s; loaded machine?): {skipped}"
    assert [(row["engine"], row["compiled"]) for row in report["parity"]] == [
        ("local", False), ("parallel/selective", False), ("parallel/moe", False), ("local", True),
        ("parallel/selective", True)], report["parity"]
    assert all(row["ok"] for row in report["parity"]), report["parity"]
    (attention,) = report["attention"]  # CPU: the flash kernel for CPU takes every path, masks included
    assert attention["ok"] and attention["causal_flash_eligible"], attention
    for path in ("causal", "document", "document_dense", "explicit_mask"):
        assert attention[f"{path}_kernels"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"], attention
        assert attention[f"{path}_ms"] > 0, attention
    (rank0,) = report["slice"]
    assert rank0["layout"] == "tp8 pp4 dp_shard32 zero3" and rank0["n_micro"] == 4, rank0
    assert rank0["tracker_peak_gib"] > 0 and rank0["planner_peak_gib"] > 0 and rank0["states_gib"] > 0, rank0
    (kernel,) = report["kernels"]
    assert kernel["available"] and kernel["ok"] and kernel["max_rel_diff"] < 1e-5, kernel
    (ckpt,) = report["checkpoint"]
    assert ckpt["bitwise"] and ckpt["host_bytes"] > 0, ckpt
    runs = report["throughput"]
    assert {(r["model"], r["compiled"]) for r in runs} == {("tiny", False), ("tiny", True)}
    _assert_planner_flop_convention(report, runs)
    assert all(r["tokens_per_s"] > 0 and r["planner_peak_gib"] > 0 for r in runs)
    for r in runs:  # the tax: Tessera's step over the plain Llama's, same weights, batch and compile mode
        assert r["framework_tax"] == pytest.approx(r["step_s"] / r["reference_step_s"]), r
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


def test_a_failing_case_is_reported_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A case that raises (say, out of memory on the GPU) becomes an error row; later cases still run, and the
    exit status says something failed."""
    sys.path.insert(0, str(ROOT))
    import bench.gpu_bench as gpu_bench

    calls: list[tuple[str, bool]] = []

    def throughput(report: object, device: object, case: dict, compiled: bool, *rest: object) -> dict:
        calls.append((case["name"], compiled))
        if not compiled:
            raise RuntimeError("CUDA out of memory (simulated)")
        row = {"model": case["name"], "compiled": True, "tokens_per_s": 100.0, "flops_per_token": 1e6,
               "seq": 32, "micro_batch": 2, "mfu": 0.5}
        report.add("throughput", row)  # type: ignore[attr-defined]
        return row

    def slice_dies(*args: object) -> dict:
        raise RuntimeError("gpu_slice.py exit 1: CUDA out of memory (simulated)")

    monkeypatch.setattr(gpu_bench, "throughput", throughput)
    monkeypatch.setattr(gpu_bench, "parity", lambda *a, **k: None)
    monkeypatch.setattr(gpu_bench, "rank0_slice", slice_dies)
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--dry", "--out", str(tmp_path / "r.json"),
                                      "--calibration", str(tmp_path / "c.json")])
    assert gpu_bench.main() == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert calls == [("tiny", False), ("tiny", True)]
    assert report["throughput"][0] == {"model": "tiny", "compiled": False,
                                       "error": "RuntimeError: CUDA out of memory (simulated)"}
    assert report["calibration"]["from"]["compiled"] is True
    assert report["slice"] == [{"error": "RuntimeError: gpu_slice.py exit 1: CUDA out of memory (simulated)"}]


def _assert_planner_flop_convention(report: dict, runs: list[dict]) -> None:
    """The check's MFU counts FLOPs as the planner (and the observer) do: non-causal, one function."""
    from framework.config import load_config
    from framework.plan.estimate import estimate
    from framework.plan.hardware import get_hardware
    from framework.plan.layout import Layout, Precision, Workload
    from models.flops import MFU_CAUSAL, flops_per_token

    assert report["meta"]["mfu_convention"] == {"causal": MFU_CAUSAL, "flops": "models.flops.mfu_flops_per_token"}
    assert MFU_CAUSAL is False
    for r in runs:
        cfg = load_config(ROOT / "configs/smoke/tiny.yaml", ["model.preset=test-tiny", "model.n_layers=2",
                                                             f"data.seq_len={r['seq']}", "data.vocab_size=512"])
        tokens = r["seq"] * r["micro_batch"]
        planned = estimate(Workload(cfg.model, r["seq"], r["micro_batch"], Precision.named("fp32")), Layout(),
                           get_hardware("h100-80g"))
        assert r["flops_per_token"] == planned.flops[0] / tokens == flops_per_token(cfg.model, r["seq"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * planned.flops[0] / tokens / (989.0 * 1e12))
        assert r["reference_mfu"] == pytest.approx(
            r["reference_tokens_per_s"] * planned.flops[0] / tokens / (989.0 * 1e12))


def test_the_time_budget_counts_from_the_shell_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_check.sh's hard timeout runs from its own start: the phase gates must count the seconds spent before
    gpu_bench.py's report exists (imports, CUDA start) too, or a last phase starts that the timeout cuts."""
    import time

    sys.path.insert(0, str(ROOT))
    import bench.gpu_bench as gpu_bench

    monkeypatch.setenv("GPU_CHECK_T0", str(time.time() - 100.0))
    left = gpu_bench.Report(tmp_path / "r.json", {}).left(450.0)
    assert 340.0 < left <= 350.0, left
    monkeypatch.delenv("GPU_CHECK_T0")
    assert gpu_bench.Report(tmp_path / "r.json", {}).left(450.0) > 449.0  # run by hand: from its own start
