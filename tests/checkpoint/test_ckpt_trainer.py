"""The trainer's fault tolerance in one process: corrupt-checkpoint fallback, refusals, NaN skip and rollback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from framework.base.errors import CheckpointError
from framework.config import Config
from framework.testing.tiny import tiny_config
from framework.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(run: Path, *overrides: str) -> Config:
    return tiny_config(run, *["data.seed=7", "train.steps=10", "checkpoint.interval=2",
                              "train.warmup_steps=2", *overrides])


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "train":
            out[rec["step"]] = rec["loss"]
    return out


def test_truncated_shard_falls_back_and_refusals_name_the_field(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    Trainer(tiny(ref)).train()
    Trainer(tiny(run)).train(stop_at=6)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_4", "step_6"]
    shard = next((ckpts / "step_6").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    with pytest.raises(CheckpointError, match=r"model.n_layers is 2 in this run but 4"):
        Trainer(tiny(run, "model.n_layers=2")).train()
    with pytest.raises(CheckpointError, match=r"data fingerprint .*data.seed: 7 -> 8"):
        Trainer(tiny(run, "data.seed=8")).train()

    result = Trainer(tiny(run)).train()
    log = (run / "train.log").read_text()
    assert "skipping checkpoint step_6" in log and "truncated" in log
    assert result.start_step == 4
    assert losses(run) == losses(ref)  # bitwise: the fallback resume is exact


def test_nan_steps_are_skipped_then_rolled_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny(run, "checkpoint.guard.max_consecutive=2", "checkpoint.guard.min_history=8",
               "checkpoint.guard.window=8")
    trainer = Trainer(cfg)
    engine = trainer.engine
    real_fb = engine.forward_backward
    calls = {"n": 0}
    poisoned = {3, 5, 6}  # the 3rd call: one skip; the 5th and 6th: two in a row -> rollback to step 4

    def forward_backward(batch: torch.Tensor) -> float:
        calls["n"] += 1
        loss = real_fb(batch)
        if calls["n"] in poisoned:
            next(engine.model.parameters()).grad.fill_(math.nan)  # type: ignore[union-attr]
            return math.nan
        return loss

    engine.forward_backward = forward_backward  # type: ignore[method-assign]
    result = trainer.train()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    skipped = [(r["step"], r["guard"]) for r in train if r["skipped"]]
    assert skipped == [(3, "nonfinite_loss"), (5, "nonfinite_loss"), (6, "nonfinite_loss")]
    rollback = [r for r in records if r["type"] == "rollback"]
    g = cfg.train.global_batch_size
    assert rollback == [{"type": "rollback", "step": 4, "from_step": 6, "skipped_samples": [4 * g, 6 * g],
                         "checkpoint": "step_4"}]
    log = (run / "train.log").read_text()
    assert "rolled back to step_4" in log and "step 3 skipped (nonfinite_loss" in log
    # Training continued after the rollback to the end, on fresh data, with finite losses.
    assert result.final_step == 10 and calls["n"] == 12
    assert [r["step"] for r in train[-4:]] == [7, 8, 9, 10] and all(math.isfinite(r["loss"]) for r in train[-4:])
    assert trainer.loader.consumed_samples == 12 * g
    assert trainer.ft.guard.skipped_total == 3 and trainer.ft.guard.rollbacks == 1
    # The skipped step changed nothing: AdamW counted 9 updates (10 steps + 2 replayed, minus 3 skipped).
    opt_state = trainer.engine.optimizers[0].state_dict()["state"]
    assert {int(s["step"]) for s in opt_state.values()} == {9}
