"""Each resume rule (framework/checkpoint/resume_rules.py, docs/CHECKPOINTS.md) on crafted checkpoint metadata, and
train.steps end to end: never a silent reshape of the LR schedule."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.resume_rules import check_resume
from framework.config import load_config, to_dict
from framework.errors import CheckpointError
from framework.testing.tiny import TINY
from framework.train.lr_schedule import lr_at
from framework.train.trainer import Trainer

STEP = 10


def _meta() -> tuple[dict[str, Any], dict[str, Any]]:
    config = to_dict(load_config(TINY, ["train.steps=100", "train.schedule=cosine"]))
    config["data"]["schedule"] = [{"start_step": 5, "weights": {"a": 1.0}}]
    return {"step": STEP, "config": copy.deepcopy(config), "data_fingerprint": "fp-old", "data_build": "b1"}, config


def _check(config: dict[str, Any], fp: str = "fp-old", build: str = "b1", **flags: Any) -> list[str]:
    meta, _ = _meta()
    return check_resume(meta, config, fp, CheckpointConfig(**flags), data_build=build)


def test_allowed_silently_eval_logging_and_checkpoint_settings() -> None:
    _, config = _meta()
    config["train"].update(eval_interval=7, eval_batches=2, log_interval=5)
    config["checkpoint"]["interval"] = 3
    assert _check(config) == []


def test_train_steps_needs_the_flag_that_says_how_the_lr_continues() -> None:
    _, config = _meta()
    config["train"]["steps"] = 200
    with pytest.raises(CheckpointError, match=r"train.steps is 200 .* but 100 .*checkpoint.steps_change=reshape"):
        _check(config)
    (note,) = _check(config, steps_change="reshape")
    old, new = (lr_at(load_config(TINY, [f"train.steps={n}"]).train, STEP) for n in (100, 200))
    assert f"{old:.3e} -> {new:.3e}" in note and old != new
    config["train"]["schedule"] = "constant"  # the LR does not depend on the total
    assert _check(config) == []


def test_global_batch_size_needs_a_flag() -> None:
    _, config = _meta()
    config["train"]["global_batch_size"] = 16
    with pytest.raises(CheckpointError, match=r"checkpoint\.allow_batch_size_change=true"):
        _check(config)
    assert "16" in _check(config, allow_batch_size_change=True)[0]


def test_new_future_schedule_phase_is_allowed_but_not_a_seen_one() -> None:
    _, config = _meta()
    config["data"]["schedule"].append({"start_step": 50, "weights": {"a": 0.5}})  # an annealing phase to come
    assert "after step 10" in _check(config, fp="fp-new")[0]
    with pytest.raises(CheckpointError, match=r"data fingerprint"):  # the same change on another build
        _check(config, fp="fp-new", build="b2")
    config["data"]["schedule"][0]["start_step"] = 3  # a phase already trained on
    with pytest.raises(CheckpointError, match=r"data fingerprint"):
        _check(config, fp="fp-new")
    assert _check(config, fp="fp-new", allow_data_change=True)


def test_data_seen_and_model_shape_are_refused() -> None:
    _, config = _meta()
    config["data"]["seed"] = 99
    with pytest.raises(CheckpointError, match=r"allow_data_change"):
        _check(config, fp="fp-new")
    _, config = _meta()
    config["model"]["n_layers"] = config["model"].get("n_layers", 2) + 1
    with pytest.raises(CheckpointError, match=r"model\.n_layers .*allow_model_change"):
        _check(config)


def test_changed_train_steps_never_reshapes_silently(tmp_path: Path) -> None:
    common = [f"run.dir={tmp_path / 'run'}", "checkpoint.interval=0", "train.eval_interval=0"]
    Trainer(load_config(TINY, [*common, "train.steps=8"])).train(stop_at=4)
    with pytest.raises(CheckpointError, match=r"train\.steps is 12"):
        Trainer(load_config(TINY, [*common, "train.steps=12"])).train()
    cfg = load_config(TINY, [*common, "train.steps=12", "checkpoint.steps_change=reshape"])
    assert Trainer(cfg).train().final_step == 12
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
           if json.loads(line)["type"] == "train"]
    assert lrs[4:] == [lr_at(cfg.train, s) for s in range(4, 12)]  # the new total's schedule, from step 4 on
