"""Real single-process runs, real signals: a kill in the middle of a save, SIGUSR1 requeue.

(SIGKILL at a random step is shown on 4 ranks in test_ckpt_multirank.py; here the kill-during-save restart proves
the single-process exact resume.)

Every run is `python -m framework.cli train configs/smoke/tiny.yaml ...` (or the same with one injected fault,
tests/checkpoint/fault_worker.py); a resumed run must log bitwise the same per-step losses as the uninterrupted
reference.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from ckpt_procs import Ranks, fault_argv, train_argv, train_losses, wait_for

from framework.checkpoint import REQUEUE_EXIT_CODE

STEPS = 10
COMMON = (f"train.steps={STEPS}", "checkpoint.interval=2", "train.warmup_steps=2")

Launch = Callable[..., Ranks]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Per-step losses of the uninterrupted single-process run."""
    run = tmp_path_factory.mktemp("ref") / "run"
    ranks = Ranks(train_argv(run, *COMMON), 1, run.parent / "logs")
    assert ranks.wait() == [0], ranks.logs()
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.slow
def test_kill_during_save_keeps_previous_latest(tmp_path: Path, launch: Launch,
                                                reference: dict[int, float]) -> None:
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    # Asynchronous saves: the kill lands in the background commit of step 6.
    killed = launch(fault_argv("kill-in-commit:6", run, *COMMON, "checkpoint.async_save=true"))
    assert killed.wait() == [-signal.SIGKILL], killed.logs()
    assert (ckpts / "latest").read_text().strip() == "step_4"
    assert (ckpts / ".tmp-step_6" / "meta.json").exists() and not (ckpts / "step_6").exists()
    resumed = launch(train_argv(run, *COMMON, "checkpoint.async_save=true"))
    assert resumed.wait() == [0], resumed.logs()
    logs = resumed.logs()
    assert "removed" in logs and ".tmp-step_6" in logs and "resumed from step_4" in logs
    assert train_losses(run) == reference


@pytest.mark.slow
def test_sigusr1_saves_within_one_step_and_exits_with_requeue_code(tmp_path: Path, launch: Launch) -> None:
    run = tmp_path / "run"
    ranks = launch(train_argv(run, "train.steps=100000", "checkpoint.interval=0"))
    wait_for(lambda: max(train_losses(run), default=0) >= 3, ranks)
    seen = max(train_losses(run))
    ranks.procs[0].send_signal(signal.SIGUSR1)
    assert ranks.wait() == [REQUEUE_EXIT_CODE], ranks.logs()
    saved = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    # The signal arrived after step `seen` was logged: the save is at the first step boundary after it.
    assert seen <= saved <= seen + 2
    assert max(train_losses(run)) == saved
    meta = json.loads((run / "checkpoints" / f"step_{saved}" / "meta.json").read_text())
    assert meta["step"] == saved and "stopping at step" in ranks.logs() and "SIGUSR1" in ranks.logs()
