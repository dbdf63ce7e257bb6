"""`tessera launch local`: validation before any process, the torchrun command, and a real 2-rank run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.base.errors import ParallelismError
from framework.cli import main
from framework.testing.tiny import TINY
from launch.local import layout_world, rank_command, rank_envs, validate


def test_bad_layout_is_refused_before_launch() -> None:
    with pytest.raises(ParallelismError, match="world size is 3"):
        validate(TINY, ["parallel.tp=2", "parallel.dp_shard=2"], 3)
    assert main(["launch", "local", "--nproc", "3", TINY, "parallel.tp=4"]) == 2
    for bad in (0, -2):
        with pytest.raises(ParallelismError, match=f"--nproc {bad} must be >= 1"):
            validate(TINY, [], bad)


def test_command_and_layout_world() -> None:
    assert rank_command(["train", TINY, "parallel.tp=2"], python="py") == [
        "py", "-m", "framework.cli", "train", TINY, "parallel.tp=2"]
    envs = rank_envs(2, 1, 12345)
    assert [(e["RANK"], e["WORLD_SIZE"], e["MASTER_PORT"]) for e in envs] == [("0", "2", "12345"), ("1", "2", "12345")]
    assert layout_world(str(Path(TINY).with_name("smoke.yaml")), []) == 8


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_run_matches_one_process(tmp_path: Path) -> None:
    """TP2 through torchrun trains the tiny model to the same losses as the 1-process CLI run."""
    common = [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=3", "checkpoint.interval=0",
              "checkpoint.save_final=false", "train.eval_interval=0"]
    assert main(["train", TINY, f"run.dir={tmp_path / 'one'}", *common]) == 0
    assert main(["launch", "local", "--nproc", "2", TINY, f"run.dir={tmp_path / 'two'}", "parallel.tp=2",
                 *common]) == 0
    losses = []
    for name in ("one", "two"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses.append([r["loss"] for r in map(json.loads, lines) if r.get("type") == "train"])
    assert len(losses[0]) == 3
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
