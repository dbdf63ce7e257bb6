"""`latest` decides the resume, not the newest step (framework/checkpoint/dcp.py `candidates`): a newer step that
`latest` does not name — a later run's checkpoint kept after a rollback or a fallback moved `latest` back — is
tried only after the one `latest` names. The expected order is the documented one (docs/CHECKPOINTS.md). A
directory that matches `step_*` without being `step_<N>` is no checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.dcp import candidates, latest_checkpoint, save_checkpoint, step_of, write_latest
from framework.checkpoint.manager import CheckpointManager


def test_latest_is_tried_before_a_newer_step(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    model = torch.nn.Linear(3, 2)
    for step in (2, 4, 6):
        save_checkpoint(root, step, [model], [torch.optim.AdamW(model.parameters())], {})
    assert latest_checkpoint(root) == root / "step_6"  # control: a commit moves `latest` to itself
    write_latest(root, "step_4")  # a rollback to step 4: step_6 stays on disk
    assert latest_checkpoint(root) == root / "step_4"
    assert candidates(root) == [root / "step_4", root / "step_6", root / "step_2"]
    assert CheckpointManager(CheckpointConfig(), root).resume_point() == root / "step_4"
    (root / "latest").unlink()  # without a pointer: newest first
    assert latest_checkpoint(root) is None and candidates(root)[0] == root / "step_6"


def test_a_renamed_copy_beside_the_steps_is_not_a_checkpoint(tmp_path: Path) -> None:
    # An operator's copy ("step_4_backup", "step_final") matches the step_* glob but is no step: the resume walk
    # and pruning pass over it instead of reading a step number out of it (or crashing on one).
    root = tmp_path / "checkpoints"
    model = torch.nn.Linear(3, 2)
    for step in (2, 4):
        save_checkpoint(root, step, [model], [torch.optim.AdamW(model.parameters())], {})
    for name in ("step_4_backup", "step_final"):
        (root / name).mkdir()
    assert [step_of(root / n) for n in ("step_4", "step_0", "step_4_backup", "step_final", "steps_4")] == [
        4, 0, None, None, None]
    assert candidates(root) == [root / "step_4", root / "step_2"]
