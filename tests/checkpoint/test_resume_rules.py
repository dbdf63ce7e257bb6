"""Each resume rule (framework/checkpoint/resume_rules.py, docs/CHECKPOINTS.md) on crafted checkpoint metadata;
train.steps end to end (never a silent reshape of the LR schedule) and a batch-size change under data.schedule end
to end (the data seen stays, later phases start at their steps)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from framework.base.errors import CheckpointError
from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.resume_rules import check_resume
from framework.config import load_config, to_dict
from framework.testing.tiny import TINY
from framework.train.lr_schedule import lr_at, section_lr_at
from framework.train.trainer import Trainer

STEP = 10


def _meta() -> tuple[dict[str, Any], dict[str, Any]]:
    config = to_dict(load_config(TINY, ["train.steps=100", "train.schedule=cosine"]))
    config["data"]["schedule"] = [{"start_step": 5, "weights": {"a": 1.0}}]
    return {"step": STEP, "config": copy.deepcopy(config), "data_fingerprint": "fp-old", "data_build": "b1"}, config


def _check(config: dict[str, Any], fp: str = "fp-old", build: str = "b1", **flags: Any) -> list[str]:
    meta, _ = _meta()
    return check_resume(meta, config, fp, CheckpointConfig(**flags), data_build=build, lr_at=section_lr_at)


def test_allowed_silently_eval_logging_and_checkpoint_settings() -> None:
    _, config = _meta()
    config["train"].update(eval_interval=7, eval_batches=2, log_interval=5)
    config["checkpoint"]["interval"] = 3
    assert _check(config) == []


def test_another_optimizer_is_refused() -> None:
    _, config = _meta()
    config["train"]["optimizer"] = "muon"
    with pytest.raises(CheckpointError, match=r"train.optimizer is muon in this run but adamw .*restore"):
        _check(config)


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


def test_batch_size_change_with_data_schedule_needs_only_its_own_flag() -> None:
    _, config = _meta()
    config["train"]["global_batch_size"] = 16
    # The phases after the step move (fingerprint fp-new) but the data config and build are the same.
    (gbs, phases) = _check(config, fp="fp-new", allow_batch_size_change=True)
    assert "8 -> 16" in gbs and "after step 10 start at their steps under the new batch size" in phases
    with pytest.raises(CheckpointError, match=r"allow_batch_size_change"):
        _check(config, fp="fp-new")
    config["data"]["schedule"][0]["start_step"] = 3  # and a phase already trained on: still data already seen
    with pytest.raises(CheckpointError, match=r"data fingerprint .*allow_data_change"):
        _check(config, fp="fp-new", allow_batch_size_change=True)


def test_batch_size_change_keeps_started_phases_and_steps_later_ones(stdlib_build, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """8 -> 4 sequences per step at step 5 of a 3-phase schedule (phases at steps 3 and 9): the 40 samples seen are
    unchanged, phase 1 goes on from sample 40 and phase 2 starts at step 9 = sample 40 + 4 x 4 = 56 (not 72)."""
    from framework.checkpoint.dcp import read_meta

    common = [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={stdlib_build.cfg.cache_dir}", "data.kind=stdlib",
              "data.seq_len=64", "data.vocab_size=4096", "model.vocab_size=4096", "train.steps=12",
              "checkpoint.interval=0", "train.eval_interval=0", "train.schedule=constant",
              "data.weights={code: 0.5, prose: 0.5}",
              "data.schedule=[{start_step: 3, weights: {code: 1.0}}, {start_step: 9, weights: {prose: 1.0}}]"]
    first = Trainer(load_config(TINY, [*common, "train.global_batch_size=8"]))
    assert first.train(stop_at=5).final_step == 5
    before = first.data.train
    small = [*common, "train.global_batch_size=4", "train.micro_batch_size=2"]
    with pytest.raises(CheckpointError, match=r"allow_batch_size_change"):
        Trainer(load_config(TINY, small)).train()
    second = Trainer(load_config(TINY, [*small, "checkpoint.allow_batch_size_change=true"]))
    assert second.train().final_step == 12  # no allow_data_change needed
    after = second.data.train
    assert [before.locate(j) for j in range(40)] == [after.locate(j) for j in range(40)]  # the data seen
    code, prose = after.names.index("code"), after.names.index("prose")
    assert {after.locate(j)[0] for j in range(40, 56)} == {code}
    assert {after.locate(j)[0] for j in range(56, 64)} == {prose}
    assert {before.locate(j)[0] for j in range(56, 72)} == {code}  # at 8 per step phase 2 would start at 72
    final = read_meta(tmp_path / "run" / "checkpoints" / "step_12")
    assert final["batch_history"] == [[0, 0, 8], [5, 40, 4]] and final["loader"]["consumed_samples"] == 68
