"""`tessera preflight`: passes on the smoke config; fails at the right stage, with the reason, on a broken one."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.cli import main
from framework.config import load_config
from framework.drivers.preflight import run_preflight

SMOKE = "configs/smoke/smoke.yaml"


def _short(stdlib_build, run_dir: Path) -> list[str]:  # type: ignore[no-untyped-def]
    """Overrides that keep the smoke config's model and optimizer but make each stage short."""
    return [f"run.dir={run_dir}", f"data.cache_dir={stdlib_build.cfg.cache_dir}", "data.seq_len=64",
            "observe.preflight.batch_steps=10",
            "observe.preflight.full_steps=4", "train.eval_batches=2"]


@pytest.mark.slow
def test_preflight_passes_on_smoke_config(stdlib_build, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["preflight", SMOKE, *_short(stdlib_build, tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    for n, name in enumerate(("dirs", "overfit", "batch", "full")):
        assert f"[PASS] stage {n} {name}" in out, out
    assert "saved and reloaded bit-exactly" in out and "preflight PASSED" in out
    assert not (tmp_path / "run" / "preflight").exists()  # the scratch run is removed


def test_learning_rate_10_fails_at_the_batch_stage(stdlib_build, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(SMOKE, [*_short(stdlib_build, tmp_path / "run"), "train.lr=10"])
    report = run_preflight(cfg)
    assert [s.status for s in report.stages] == ["PASS", "PASS", "FAIL", "SKIP"]
    failed = report.failed_stage
    assert failed is not None and failed.name == "batch"
    assert "train.lr=10" in failed.reason and "lower train.lr" in failed.reason


def test_unwritable_run_dir_fails_at_the_dirs_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["preflight", SMOKE, f"run.dir={blocker / 'run'}"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] stage 0 dirs" in out and "is not writable" in out and "run.dir" in out
    assert "[SKIP] stage 1 overfit" in out and "preflight FAILED at stage 0 (dirs)" in out


def test_no_room_for_checkpoints_fails_at_the_dirs_stage(tmp_path: Path) -> None:
    cfg = load_config(SMOKE, [f"run.dir={tmp_path / 'run'}", "observe.preflight.disk_headroom=1000000000000"])
    report = run_preflight(cfg)
    failed = report.failed_stage
    assert failed is not None and failed.number == 0 and "free; needs" in failed.reason
