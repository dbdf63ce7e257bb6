"""The training loop on one process: exact resume, run directory contents, metrics truncation, schedules."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from framework.testing.tiny import tiny_config
from framework.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, name: str, *extra: str):  # type: ignore[no-untyped-def]
    return tiny_config(tmp_path / name, *["train.steps=8", "checkpoint.interval=0", *extra])


def test_exact_resume_bitwise(tmp_path: Path) -> None:
    """A run stopped after step k and started again logs bitwise the same losses as an uninterrupted run."""
    full = Trainer(_cfg(tmp_path, "full")).train()
    assert sorted(full.losses) == list(range(1, 9))
    first = Trainer(_cfg(tmp_path, "resumed")).train(stop_at=3)
    assert first.final_step == 3
    second = Trainer(_cfg(tmp_path, "resumed")).train()
    assert second.start_step == 3
    assert {**first.losses, **second.losses} == full.losses  # exact float equality
    # metrics.jsonl reads as one run
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed/metrics.jsonl").read_text().splitlines()
             if json.loads(line)["type"] == "train"]
    assert steps == list(range(1, 9))


def test_metrics_after_resume_point_are_dropped(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "run", "checkpoint.interval=2")
    Trainer(cfg).train(stop_at=5)  # checkpoints at 2, 4 and the stop at 5
    metrics = tmp_path / "run/metrics.jsonl"
    with metrics.open("a") as f:
        f.write(json.dumps({"type": "train", "step": 6, "loss": 0.0}) + "\n")
        f.write('{"type": "train", "st')  # a torn line from a killed process
    Trainer(cfg).train()
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_steps = [r["step"] for r in recs if r["type"] == "train"]
    assert train_steps == list(range(1, 9))
    assert all(r["loss"] != 0.0 for r in recs if r["type"] == "train")


def test_run_directory_contents(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "run", "checkpoint.interval=4", "checkpoint.keep_last=1")
    Trainer(cfg).train()
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 8
    assert (run / "train.log").read_text().count("step") >= 8
    assert (run / "checkpoints/latest").read_text().strip() == "step_8"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_8"]
    rec = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "memory_mb"):
        assert key in rec


def test_logged_lr_follows_schedule(tmp_path: Path) -> None:
    from framework.train.lr_schedule import lr_at

    cfg = _cfg(tmp_path, "wsd", "train.schedule=wsd", "train.steps=10", "train.lr=3e-3")
    Trainer(cfg).train()
    recs = [json.loads(line) for line in (tmp_path / "wsd/metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in recs if r["type"] == "train"]
    assert lrs == [lr_at(cfg.train, s) for s in range(10)]
    assert lrs[-1] < lrs[5] == cfg.train.lr


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs(tmp_path: Path, precision: str) -> None:
    res = Trainer(_cfg(tmp_path, precision, f"train.precision={precision}", "train.steps=4")).train()
    assert all(v == v for v in res.losses.values())  # finite (not NaN)


def test_deterministic_sets_the_cublas_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """train.deterministic=true without CUBLAS_WORKSPACE_CONFIG would leave cuBLAS matmuls nondeterministic (and
    torch warns at each); a value the user exported is kept."""
    from framework.train.trainer import seed_everything

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seed_everything(1, deterministic=False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    try:
        seed_everything(1, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        seed_everything(1, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)
