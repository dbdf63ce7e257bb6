"""`tessera preflight`: passes on the smoke config, its TP2 layout run through `launch local` and matching the single
process; fails at the right stage, with the reason, on a broken one; says plainly which stages it skipped."""

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
@pytest.mark.distributed
def test_preflight_passes_on_smoke_config_and_runs_its_tp2_layout(stdlib_build, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    tp2 = ["parallel.pp=1", "parallel.dp_shard=1"]  # the smoke config's TP2, on 2 ranks (its 8-rank layout costs more)
    assert main(["preflight", SMOKE, *_short(stdlib_build, tmp_path / "run"), *tp2]) == 0
    out = capsys.readouterr().out
    for n, name in enumerate(("dirs", "overfit", "batch", "full", "layout")):
        assert f"[PASS] stage {n} {name:8s}" in out, out
    assert "saved and reloaded bit-exactly" in out and "preflight PASSED\n" in out
    layout = out.split("[PASS] stage 4 layout   ")[1].splitlines()[0]
    assert "TP2, ZeRO-1 (2 ranks) through `tessera launch local --nproc 2`" in layout, layout
    assert "stopped at step 2 and resumed" in layout, layout
    worst = float(layout.split("single process within ")[1].split()[0])
    assert worst <= 1e-4, layout  # fp32 TP2 computes the single-process model (tests/parallel parity: ~1e-6)
    assert not (tmp_path / "run" / "preflight").exists()  # the scratch runs are removed
    assert not (tmp_path / "run" / "preflight-layout").exists()


def _stub_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stages 0-3 replaced by instant passes (stage 3 hands stage 4 its losses), so stage 4 alone is tested."""
    import framework.drivers.preflight as pf

    monkeypatch.setattr(pf, "stage_dirs", lambda cfg: "ok")
    monkeypatch.setattr(pf, "stage_overfit", lambda cfg, data: "ok")
    monkeypatch.setattr(pf, "stage_batch", lambda cfg, data: "ok")
    monkeypatch.setattr(pf, "stage_full", lambda cfg, keep, out: out.extend([8.0, 7.0, 6.0, 5.0]) or "ok")
    monkeypatch.setattr("data_pipeline.read.prepare.prepare_data", lambda *a, **k: None)


def test_a_layout_this_node_cannot_run_is_skipped_and_the_verdict_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import framework.drivers.preflight as pf

    _stub_ladder(monkeypatch)
    monkeypatch.setattr(pf, "_local_slots", lambda cfg: 4)  # a node with 4 GPUs; the smoke layout needs 8
    assert main(["preflight", SMOKE, f"run.dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "[SKIP] stage 4 layout   the layout TP2 x PP2 x DP2, ZeRO-1 (8 ranks) needs 8 GPUs and this node has 4: " \
           "the parallel layout was not tested; run it on its nodes before the real job: `tessera launch slurm " \
           "--nodes 2 --gpus-per-node 4 --stop-at 6 configs/smoke/smoke.yaml" in out, out
    assert "preflight PASSED the stages it ran; SKIPPED stage 4 (layout): not tested here" in out
    assert "preflight PASSED\n" not in out
    cfg = load_config(SMOKE, [f"run.dir={tmp_path / 'run'}"])
    report = run_preflight(cfg)  # no config file: the ranks could not load one
    assert report.passed and [s.name for s in report.skipped] == ["layout"]
    assert "none was given" in report.skipped[0].reason
    assert main(["preflight", SMOKE, f"run.dir={tmp_path / 'run'}", "--skip-layout"]) == 0
    assert "[SKIP] stage 4 layout   --skip-layout: the parallel layout TP2 x PP2 x DP2" in capsys.readouterr().out


def test_a_failing_layout_fails_stage_4_with_its_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import framework.drivers.preflight as pf

    _stub_ladder(monkeypatch)
    monkeypatch.setattr(pf, "_local_slots", lambda cfg: None)  # CPU: any number of gloo ranks

    def crash(nproc, config, overrides, *, extra, output):  # type: ignore[no-untyped-def]
        output.write("rank 1: RuntimeError: boom\n")
        return 3

    monkeypatch.setattr("launch.local.run_local", crash)
    assert main(["preflight", SMOKE, f"run.dir={tmp_path / 'run'}"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] stage 4 layout   the layout TP2 x PP2 x DP2, ZeRO-1 (8 ranks) exited with code 3 before " \
           "its resume" in out and "rank 1: RuntimeError: boom" in out, out
    assert (tmp_path / "run" / "preflight-layout" / "launch.log").is_file()  # kept for the post-mortem


def test_learning_rate_10_fails_at_the_batch_stage(stdlib_build, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(SMOKE, [*_short(stdlib_build, tmp_path / "run"), "train.lr=10"])
    report = run_preflight(cfg)
    assert [s.status for s in report.stages] == ["PASS", "PASS", "FAIL", "SKIP", "SKIP"]
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
