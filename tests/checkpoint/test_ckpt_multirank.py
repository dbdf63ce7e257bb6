"""Multi-rank must-shows on the parallel engine (CPU, gloo).

- TP2 x DP2, 4 real `tessera train` processes: SIGUSR1 to one rank only -> all ranks agree, save within one step,
  exit 42; the requeued run is SIGKILLed at a random step; the restart finishes with bitwise the uninterrupted
  losses.
- Reshard: saved at TP2 x PP2 x DP2 (8 ranks), loaded at DP4 and on one process: later losses within 1e-5.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_procs import TINY, Ranks, train_argv, train_losses, wait_for

from framework.checkpoint import REQUEUE_EXIT_CODE
from framework.config import load_config
from framework.testing import run_distributed
from framework.train.trainer import Trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 10
TP2_DP2 = (f"train.steps={STEPS}", "checkpoint.interval=2", "train.warmup_steps=2", "parallel.tp=2",
           "parallel.dp_shard=2")
Launch = Callable[..., Ranks]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("ref4") / "run"
    ranks = Ranks(train_argv(run, *TP2_DP2), 4, run.parent / "logs")
    assert ranks.wait() == [0] * 4, ranks.logs()
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_tp2_dp2_sigusr1_requeue_then_sigkill_at_random_step_resume_bitwise(
        tmp_path: Path, launch: Launch, reference: dict[int, float]) -> None:
    run = tmp_path / "run"
    # 1. SIGUSR1 to one rank only: the others learn it from the all-reduce; all save within one step, exit 42.
    first = launch(train_argv(run, *TP2_DP2), world=4)
    wait_for(lambda: max(train_losses(run), default=0) >= 2, first)
    seen = max(train_losses(run))
    first.procs[3].send_signal(signal.SIGUSR1)
    assert first.wait() == [REQUEUE_EXIT_CODE] * 4, first.logs()
    saved = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert seen <= saved <= seen + 2 and max(train_losses(run)) == saved, (seen, saved)
    assert "SIGUSR1" in first.logs()
    # 2. The requeued job resumes (saving asynchronously this time); SIGKILL every rank at a random later step.
    kill_after = random.Random().randint(saved + 2, STEPS - 1)
    second = launch(train_argv(run, *TP2_DP2, "checkpoint.async_save=true"), world=4)  # async changes no bit
    wait_for(lambda: max(train_losses(run), default=0) >= kill_after, second)
    second.kill(signal.SIGKILL)
    assert max(train_losses(run)) < STEPS, "the run finished before the kill; nothing was tested"
    # 3. The same command again finishes; the whole run logs bitwise the uninterrupted losses.
    third = launch(train_argv(run, *TP2_DP2), world=4)
    assert third.wait() == [0] * 4, third.logs()
    assert "resumed from step_" in third.logs()
    assert train_losses(run) == reference, f"stopped at {saved}, killed after step {kill_after}"


def _train_ranks(rank: int, world: int, overrides: list[str], stop_at: int | None) -> dict[int, float]:
    torch.set_num_threads(1)
    return Trainer(load_config(TINY, overrides)).train(stop_at=stop_at).losses


def test_reshard_tp2_pp2_dp2_to_dp4_and_one_process(tmp_path: Path) -> None:
    common = ["data.seed=7", "train.steps=8", "checkpoint.interval=4", "train.warmup_steps=2"]
    src = tmp_path / "src"
    three_d = [*common, f"run.dir={src}", "parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=2",
               "checkpoint.async_save=true"]
    uninterrupted = run_distributed(_train_ranks, 8, timeout_s=600, overrides=three_d, stop_at=None)[0]
    assert sorted(uninterrupted) == list(range(1, 9))
    for name, world, layout in (("dp4", 4, ["parallel.dp_shard=4"]), ("one", 1, [])):
        run = tmp_path / name
        shutil.copytree(src, run)
        shutil.rmtree(run / "checkpoints" / "step_8")
        (run / "checkpoints" / "latest").write_text("step_4\n")
        overrides = [*common, f"run.dir={run}", *layout]
        if world == 1:
            losses = _train_ranks(0, 1, overrides, None)
        else:
            losses = run_distributed(_train_ranks, world, timeout_s=600, overrides=overrides, stop_at=None)[0]
        assert sorted(losses) == [5, 6, 7, 8], name
        torch.testing.assert_close(torch.tensor([losses[s] for s in range(5, 9)]),
                                   torch.tensor([uninterrupted[s] for s in range(5, 9)]), atol=1e-5, rtol=0)
        meta = json.loads((run / "checkpoints" / "step_8" / "meta.json").read_text())
        assert meta["world_size"] == world
