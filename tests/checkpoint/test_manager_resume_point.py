"""CheckpointManager (framework/checkpoint/manager.py) on what the other checkpoint tests do not reach: a run whose
only checkpoint is step 0 (what `tessera ckpt import-hf` writes: docs/CHECKPOINTS.md) resumes from step_0 — the
step number 0 is falsy, the resume must not mistake it for "no step" — and the pinned host budget is read in GiB
(checkpoint.async_pin_budget_gb x 2^30 bytes), as documented; a compatibility refusal names the checkpoint it
read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from framework.base.errors import CheckpointError
from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.dcp import save_checkpoint
from framework.checkpoint.manager import CheckpointManager, check_compatible


def test_a_step_0_checkpoint_is_the_resume_point(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(CheckpointConfig(), root)
    assert manager.resume_point() is None  # control: nothing committed yet
    model = torch.nn.Linear(3, 2)
    save_checkpoint(root, 0, [model], [torch.optim.AdamW(model.parameters())], {"model_only": True})
    assert manager.resume_point() == root / "step_0"
    save_checkpoint(root, 3, [model], [torch.optim.AdamW(model.parameters())], {})
    assert manager.resume_point() == root / "step_3"


def test_the_pinned_budget_is_in_gib(tmp_path: Path) -> None:
    manager = CheckpointManager(CheckpointConfig(async_save=True, async_pin_budget_gb=0.5), tmp_path)
    assert manager.saver is not None and manager.saver.stager.pin_budget_bytes == 2**29


def test_a_refusal_names_the_checkpoint_it_read(tmp_path: Path) -> None:
    # check_compatible forwards `path` to the resume rules, whose message says which checkpoint was refused.
    saved = {"config": {"model": {"hidden": 64}, "data": {"seed": 1}}, "data_fingerprint": "aaa"}
    wider = {"model": {"hidden": 128}, "data": {"seed": 1}}
    where = tmp_path / "checkpoints" / "step_7"
    with pytest.raises(CheckpointError, match=f"checkpoint {where}"):
        check_compatible(saved, wider, "aaa", path=where)
    with pytest.raises(CheckpointError, match="the checkpoint"):  # control: without a path, the generic words
        check_compatible(saved, wider, "aaa")
