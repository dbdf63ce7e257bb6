"""wandb offline run files hold the logged metrics (read back with wandb's protobuf schema); TensorBoard too."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.observe.config import ObserveConfig, WandbConfig
from framework.observe.sinks import TensorBoardSink, build_sinks, read_wandb_offline, scalars

SECRET = "sk-tessera-test-key-0123456789abcdef"


def _records() -> list[dict]:
    out: list[dict] = [{"type": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3 * s, "grad_norm": 1.5,
                        "skipped": False, "mfu": 0.25} for s in range(1, 5)]
    out.append({"type": "eval", "step": 4, "val_loss/code": 3.25, "val_loss/prose": 4.5, "val_ppl/code": 25.8})
    out.append({"type": "summary", "step": 4, "final_loss": 1.25, "tokens_per_s": 1234.0})
    return out


def test_scalars_names() -> None:
    assert scalars({"type": "train", "step": 3, "loss": 2.0, "skipped": True, "note": "x"}) == {
        "train/loss": 2.0, "train/skipped": 1.0}
    assert scalars({"type": "eval", "step": 3, "val_loss/code": 2.0}) == {"val_loss/code": 2.0}


def test_wandb_offline_files_hold_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)  # must never reach a file we (or wandb) write
    cfg = ObserveConfig(wandb=WandbConfig(enabled=True, project="tessera-test", tags=["ci"]))
    sinks = build_sinks(cfg, tmp_path, "wb-test", {"train": {"lr": 1e-3}, "run": {"name": "wb-test"}})
    assert len(sinks) == 1
    for rec in _records():
        sinks[0].log(rec)
    sinks[0].close()

    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    run = read_wandb_offline(tmp_path / "wandb")
    assert run["run_id"] == (tmp_path / "wandb_run_id").read_text().strip()
    by_step = {h["_step"]: h for h in run["history"]}
    assert sorted(by_step) == [1, 2, 3, 4]
    for s in range(1, 5):
        assert by_step[s]["train/loss"] == pytest.approx(5.0 / s)
        assert by_step[s]["train/lr"] == pytest.approx(1e-3 * s)
    assert by_step[4]["val_loss/code"] == 3.25 and by_step[4]["val_loss/prose"] == 4.5
    assert run["summary"]["final_loss"] == 1.25
    assert run["config"]["train"] == {"lr": 1e-3}
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"API key written to {path}"


def test_wandb_online_needs_project() -> None:
    from framework.errors import ConfigError

    with pytest.raises(ConfigError, match=r"observe\.wandb\.project"):
        WandbConfig(enabled=True, mode="online").validate()


def test_tensorboard_sink(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for rec in _records():
        sink.log(rec)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(s, pytest.approx(5.0 / s)) for s in range(1, 5)]
    assert [(e.step, e.value) for e in acc.Scalars("val_loss/code")] == [(4, 3.25)]
