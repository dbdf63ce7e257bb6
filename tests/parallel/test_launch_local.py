"""`tessera launch local`: validation before any process, the torchrun command, and a real 2-rank run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.cli import main
from framework.errors import ParallelismError
from launch.local import build_command, layout_world, validate

TINY = "configs/smoke/tiny.yaml"


def test_bad_layout_is_refused_before_launch() -> None:
    with pytest.raises(ParallelismError, match="world size is 3"):
        validate(TINY, ["parallel.tp=2", "parallel.dp_shard=2"], 3)
    assert main(["launch", "local", "--nproc", "3", TINY, "parallel.tp=4"]) == 2


def test_command_and_layout_world() -> None:
    cmd = build_command(8, ["train", TINY, "parallel.tp=2"], python="py")
    assert cmd[:5] == ["py", "-m", "launch.torchrun", "--standalone", "--nproc-per-node=8"]
    assert cmd[-3:] == ["train", TINY, "parallel.tp=2"]
    assert layout_world("configs/smoke/smoke.yaml", []) == 8


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
