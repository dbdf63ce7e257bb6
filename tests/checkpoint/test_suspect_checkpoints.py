"""A checkpoint taken right after a skipped step is marked suspect by the real trainer, is never `latest`, and a
resume passes over it even when `latest` names it (the order the candidates are tried in is what makes this
test able to fail: the suspect one is tried first)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from framework.checkpoint import dcp
from framework.checkpoint.manager import find_valid_checkpoint
from framework.testing.tiny import tiny_config
from framework.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(run: Path, *extra: str):  # type: ignore[no-untyped-def]
    # max_consecutive=3: one skipped step is skipped, not rolled back; the final step is saved while skipping
    return tiny_config(run, "train.steps=6", "checkpoint.interval=3", "train.eval_interval=0",
                       "checkpoint.guard.max_consecutive=3", *extra)


def test_a_checkpoint_after_a_skipped_step_is_suspect_and_never_resumed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = Trainer(_cfg(run))
    real_fb = trainer.engine.forward_backward
    calls = {"n": 0}

    def forward_backward(batch: torch.Tensor) -> float:
        calls["n"] += 1
        loss = real_fb(batch)
        if calls["n"] == 6:  # the last step's loss is not finite: skipped, then saved as the final checkpoint
            next(trainer.engine.model.parameters()).grad.fill_(math.nan)  # type: ignore[union-attr]
            return math.nan
        return loss

    trainer.engine.forward_backward = forward_backward  # type: ignore[method-assign]
    trainer.train()
    ckpts = run / "checkpoints"
    skipped = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r["type"] == "train" and r["skipped"]]
    assert skipped == [6]
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_3", "step_6"]
    assert dcp.read_meta(ckpts / "step_6").get("guard_suspect") is True
    assert not dcp.read_meta(ckpts / "step_3").get("guard_suspect")
    assert (ckpts / "latest").read_text().strip() == "step_3"

    # `latest` names the suspect checkpoint (written by hand, as an older version or an operator might): the
    # resume must still pass over it, although it is the first candidate tried
    (ckpts / "latest").write_text("step_6\n")
    assert dcp.candidates(ckpts)[0].name == "step_6"
    assert find_valid_checkpoint(ckpts) == ckpts / "step_3"
    result = Trainer(_cfg(run)).train()
    assert result.start_step == 3 and result.final_step == 6
