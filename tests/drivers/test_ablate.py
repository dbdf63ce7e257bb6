"""`tessera ablate` end to end: the 4-mixture stdlib ablation at tiny scale, its report and PNGs, resumability,
`tessera plot`, and the SLURM job-array rendering."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from framework.cli import main

SPEC = "configs/ablations/stdlib-mix.ablate.yaml"


def _png_ok(path: Path) -> None:
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400, img.shape
    assert img[..., :3].std() > 0.05  # not a blank canvas


@pytest.mark.slow
def test_four_mixture_ablation(stdlib_build, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "abl"
    sets = ["--set", f"data.cache_dir={stdlib_build.cfg.cache_dir}", "--set", "train.eval_batches=4"]
    assert main(["ablate", SPEC, "--out", str(out), *sets]) == 0

    runs = sorted((out / "runs").iterdir())
    assert [r.name for r in runs] == ["confirm-s0", "m00-s0", "m01-s0", "m02-s0", "m03-s0"]
    confirm, runs = runs[0], runs[1:]
    results = {r.name[:3]: json.loads((r / "result.json").read_text()) for r in runs}
    assert len({(x["tokenizer_path"], x["build_dir"], json.dumps(x["val_samples"])) for x in results.values()}) == 1
    assert all(x["tokens"] == 20480 and x["final_step"] == 40 for x in results.values())

    report = (out / "report.md").read_text()
    for mid, res in results.items():  # the table holds every mixture's measured per-domain losses
        row = next(line for line in report.splitlines() if line.startswith(f"| {mid} |"))
        for dom in ("code", "prose", "tests"):
            assert f"{res['val'][f'val_loss/{dom}']:.4f}" in row
    assert "## Recommended mixture (mean objective)" in report and "leave-one-out RMSE" in report
    assert re.search(r"\*\*code 0\.\d\d, prose 0\.\d\d, tests 0\.\d\d\*\* — predicted mean loss", report)
    # The proposal was trained like a proxy (same seed, budget, held-out split) and its measured objective reported.
    summary = json.loads((out / "report.json").read_text())
    conf = json.loads((confirm / "result.json").read_text())
    assert conf["weights"] == pytest.approx(summary["proposal"], abs=1e-6) and conf["final_step"] == 40
    assert conf["val_samples"] == results["m00"]["val_samples"] and conf["train_tokens"]["code"] > 0
    measured = np.mean([conf["val"][f"val_loss/{d}"] for d in ("code", "prose", "tests")])
    assert summary["confirmation"][0] == pytest.approx(measured, abs=1e-9)
    assert f"measured {measured:.4f}" in report and "## Surrogates of the objective" in report
    for png in ("curves.png", "loss_vs_weight.png", "pareto.png", "predicted_vs_measured.png",
                "proposal_simplex.png"):
        assert f"]({png})" in report
        _png_ok(out / png)

    # Upweighting a domain 0.2 -> 0.6 lowers that domain's validation loss (on average over the three domains).
    changes = [results[hi]["val"][f"val_loss/{d}"] - results[lo]["val"][f"val_loss/{d}"]
               for d, hi, lo in (("code", "m01", "m02"), ("prose", "m02", "m01"), ("tests", "m03", "m01"))]
    assert np.mean(changes) < 0, changes

    # Resumable: finished runs are not rerun; a run whose result.json is missing is completed from its checkpoint.
    mtimes = {r.name: (r / "metrics.jsonl").stat().st_mtime_ns for r in runs}
    before = json.loads((runs[3] / "result.json").read_text())
    (runs[3] / "result.json").unlink()
    assert main(["ablate", SPEC, "--out", str(out), *sets]) == 0
    assert {r.name: (r / "metrics.jsonl").stat().st_mtime_ns for r in runs[:3]} == {
        k: v for k, v in mtimes.items() if k != "m03-s0"}
    after = json.loads((runs[3] / "result.json").read_text())
    assert after["val"] == pytest.approx(before["val"], abs=1e-6) and after["final_step"] == 40

    # `tessera plot` over two of the runs.
    png = tmp_path / "two.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "--out", str(png), "--smooth", "3"]) == 0
    _png_ok(png)


def test_slurm_array_rendering(tmp_path: Path) -> None:
    out = tmp_path / "abl"
    assert main(["ablate", SPEC, "--out", str(out), "--slurm", "--dry-run", "--max-parallel", "2",
                 "--set", "train.eval_batches=4"]) == 0
    array = (out / "ablate-array.sbatch").read_text()
    report = (out / "ablate-report.sbatch").read_text()
    assert "#SBATCH --array=0-3%2" in array and "#SBATCH --requeue" in array
    assert f"ablate {SPEC} --out {out} --set train.eval_batches=4 --array-task" in array
    assert "#SBATCH --dependency=afterok:<ARRAY_JOB_ID>" in report and "--report-only" in report
    assert not (out / "runs").exists()  # rendering trains nothing


def test_report_refuses_unfinished_runs(tmp_path: Path) -> None:
    assert main(["ablate", SPEC, "--out", str(tmp_path), "--report-only"]) == 2  # ConfigError -> exit code 2
