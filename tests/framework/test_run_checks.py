"""Values that cannot train are refused at load; metrics.jsonl is strict JSON; DCP failures are CheckpointErrors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework.base.errors import CheckpointError, ConfigError
from framework.base.run_dir import RunDir
from framework.checkpoint import dcp
from framework.config import load_config
from framework.testing.tiny import TINY


@pytest.mark.parametrize(("override", "message"), [
    ("train.eps=0", r"train\.eps=0"), ("train.lr=.inf", r"train\.lr=inf must be a finite"),
    ("train.grad_clip=.nan", r"train\.grad_clip=nan must be a finite"), ("train.eval_interval=-1", "eval_interval"),
    ("train.eval_batches=-2", "eval_batches=-2"), ("run.name=..", r"run\.name='\.\.'"),
])
def test_values_that_cannot_train_are_refused_at_load(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override])


def test_metrics_are_strict_json(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.create()
    run.append_metrics({"type": "train", "step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3,
                        "window": [1.0, float("-inf")]})
    line = run.metrics_file.read_text().strip()
    rec = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert rec["loss"] is None and rec["grad_norm"] is None and rec["lr"] == 1e-3 and rec["window"] == [1.0, None]
    assert rec["nonfinite"] == {"loss": "nan", "grad_norm": "inf", "window": "list"}


def test_dcp_failures_are_checkpoint_errors_with_path_and_cause(tmp_path: Path) -> None:
    tmp = dcp.begin_save(tmp_path, 1)
    dcp.write_shards({"model": {"w": torch.ones(4)}}, tmp)
    path = dcp.commit(tmp_path, 1, {})
    for shard in path.glob("*.distcp"):  # a crafted checkpoint: same size, garbage bytes
        shard.write_bytes(b"\x00" * shard.stat().st_size)
    with pytest.raises(CheckpointError, match=rf"could not load checkpoint {path}: .+") as err:
        dcp.load_state(path, {"model": {"w": torch.zeros(4)}})
    assert "Traceback" not in str(err.value) and "weights_only" not in str(err.value)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the checkpoint directory should be")
    with pytest.raises(CheckpointError, match=rf"could not save checkpoint {blocked / 'x'}: .+"):
        dcp.write_shards({"model": {"w": torch.ones(4)}}, blocked / "x")


def test_multi_rank_layout_as_one_process_names_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    from framework.cli import main

    assert main(["train", str(TINY), "parallel.tp=2"]) == 2
    err = capsys.readouterr().err
    assert "ParallelismError" in err and f"tessera launch local --nproc 2 {TINY} parallel.tp=2" in err


def test_launch_local_finds_a_missing_build_before_launch(tmp_path: Path) -> None:
    from framework.base.errors import DataError
    from launch.local import validate

    with pytest.raises(DataError, match="is not a finished data build"):
        validate(str(TINY), ["data.kind=build", f"data.build_dir={tmp_path / 'nope'}"], 1)
