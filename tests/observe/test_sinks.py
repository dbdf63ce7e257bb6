"""wandb offline run files hold the logged metrics (read back with wandb's protobuf schema); TensorBoard too."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.observe.config import ObserveConfig, WandbConfig
from framework.observe.sinks import TensorBoardSink, build_sinks, read_wandb_offline, scalars
from framework.testing.tiny import TINY

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
    run = read_wandb_offline(tmp_path / "wandb", wait_s=60)
    assert run["complete"]
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
    from framework.base.errors import ConfigError

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


def test_trainer_writes_wandb_tensorboard_and_observe_fields(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A real (tiny, synthetic-data) Trainer run: every sink holds the same losses as metrics.jsonl."""
    import json

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from framework.config import load_config
    from framework.train.trainer import Trainer

    torch.set_num_threads(1)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cfg = load_config(TINY, [f"run.dir={tmp_path / 'run'}", "train.eval_interval=3",
                                                  "observe.wandb.enabled=true", "observe.tensorboard=true"])
    result = Trainer(cfg).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    for r in train:
        assert 0 < r["mfu_causal"] < r["mfu"] == r["hfu"] and r["tokens_per_s_per_device"] == r["tokens_per_s"]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and "val_ppl/synthetic" in evals[0]
    assert [r["step"] for r in records if r["type"] == "checkpoint"] == [3, 6]
    summary = [r for r in records if r["type"] == "summary"]
    assert len(summary) == 1 and summary[0]["final_loss"] == result.last_loss

    run = read_wandb_offline(tmp_path / "run" / "wandb", wait_s=60)
    assert run["complete"]
    wb = {h["_step"]: h["train/loss"] for h in run["history"] if "train/loss" in h}
    assert wb == {r["step"]: pytest.approx(r["loss"]) for r in train}
    assert run["summary"]["final_loss"] == pytest.approx(result.last_loss)
    assert run["config"]["run"]["name"] == "tiny"
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert [round(e.value, 5) for e in acc.Scalars("train/loss")] == [round(r["loss"], 5) for r in train]
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"API key written to {path}"
