"""A *smaller* train.steps on resume changes the LR schedule as much as a larger one: refused without
checkpoint.steps_change=reshape, and with it the run follows the shorter schedule from the resumed step on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.base.errors import CheckpointError
from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.resume_rules import check_resume
from framework.config import load_config, to_dict
from framework.testing.tiny import TINY
from framework.train.lr_schedule import lr_at, section_lr_at
from framework.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fewer_steps_needs_the_flag_on_crafted_metadata() -> None:
    saved = to_dict(load_config(TINY, ["train.steps=100", "train.schedule=cosine"]))
    meta = {"step": 10, "config": saved}
    for new_steps in (50, 11, 99):  # shorter, down to just past the resumed step
        config = to_dict(load_config(TINY, [f"train.steps={new_steps}", "train.schedule=cosine"]))
        with pytest.raises(CheckpointError, match=rf"train.steps is {new_steps} .* but 100 "):
            check_resume(meta, config, None, CheckpointConfig())
        (note,) = check_resume(meta, config, None, CheckpointConfig(steps_change="reshape"), lr_at=section_lr_at)
        old = lr_at(load_config(TINY, ["train.steps=100", "train.schedule=cosine"]).train, 10)
        new = lr_at(load_config(TINY, [f"train.steps={new_steps}", "train.schedule=cosine"]).train, 10)
        assert f"100 -> {new_steps}" in note and f"{old:.3e} -> {new:.3e}" in note


def test_fewer_steps_end_to_end(tmp_path: Path) -> None:
    common = [f"run.dir={tmp_path / 'run'}", "checkpoint.interval=0", "train.eval_interval=0",
              "train.schedule=cosine"]
    Trainer(load_config(TINY, [*common, "train.steps=12"])).train(stop_at=4)
    with pytest.raises(CheckpointError, match=r"train\.steps is 8 in this run but 12"):
        Trainer(load_config(TINY, [*common, "train.steps=8"])).train()
    cfg = load_config(TINY, [*common, "train.steps=8", "checkpoint.steps_change=reshape"])
    assert Trainer(cfg).train().final_step == 8
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines())
           if r["type"] == "train"]
    assert len(lrs) == 8 and lrs[4:] == [lr_at(cfg.train, s) for s in range(4, 8)]
    assert lrs[4] != lr_at(load_config(TINY, [*common, "train.steps=12"]).train, 4)  # the schedule did change
