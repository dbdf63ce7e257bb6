"""Operations must-shows on 4 gloo ranks, in one process-group spawn:

- straggler: a rank slowed by observe.straggler.inject is named (rank, section, slowdown) within
  interval x persist steps; a healthy run with the same fixed seed names nobody;
- spike triage: a planted poisoned batch is classified as data, quarantined, skipped after the rollback and after a
  resume in a new Trainer, and the losses equal a run whose data never held it; a NaN injected once on one rank is
  classified as hardware, nothing is quarantined, and every rank holds the same verdicts;
- hang: one rank late to a collective; the hang watchdog's flight-recorder dumps let `doctor` name the collective,
  the group and the missing rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from framework.base.run_dir import RunDir
from framework.testing import run_distributed
from framework.testing.tiny import tiny_config
from framework.train.trainer import Trainer

pytestmark = [pytest.mark.distributed]

DP4 = ("parallel.dp_replicate=4", "parallel.zero_stage=0", "train.global_batch_size=8", "train.micro_batch_size=2")
INTERVAL, PERSIST = 2, 3


def _straggler(rank: int, base: Path, name: str, steps: int, *extra: str) -> list[dict[str, Any]]:
    cfg = tiny_config(base / name, *DP4, f"train.steps={steps}", "checkpoint.interval=0", "data.seed=11",
                      f"observe.straggler.interval={INTERVAL}", f"observe.straggler.persist={PERSIST}", *extra)
    Trainer(cfg).train()
    return RunDir(base / name).read_metrics("train") if rank == 0 else []


def _body(rank: int, world: int, base: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    out["slow_forward"] = _straggler(rank, base, "slow_fwd", 8, "observe.straggler.inject=2:forward:0.08")
    out["slow_optimizer"] = _straggler(rank, base, "slow_opt", 8, "observe.straggler.inject=1:optimizer:0.08")
    out["healthy"] = _straggler(rank, base, "healthy", 30)
    return out


@pytest.fixture(scope="module")
def ops_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("ops")
    results = run_distributed(_body, 4, timeout_s=300, base=base)
    return {"base": base, "ranks": results}


def _named(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in records if "straggler/rank" in r), None)


@pytest.mark.parametrize(("case", "rank", "section"), [("slow_forward", 2, "forward"),
                                                       ("slow_optimizer", 1, "optimizer")])
def test_a_slowed_rank_is_named_with_its_section_within_interval_x_persist_steps(
        ops_results: dict[str, Any], case: str, rank: int, section: str) -> None:
    named = _named(ops_results["ranks"][0][case])
    assert named is not None, "the slowed rank was never named"
    assert (named["straggler/rank"], named["straggler/section"]) == (rank, section)
    assert named["step"] <= INTERVAL * PERSIST and named["straggler/slowdown"] > 1.3
    assert named["straggler/host"]


def test_a_healthy_run_names_nobody(ops_results: dict[str, Any]) -> None:
    records = ops_results["ranks"][0]["healthy"]
    assert len(records) == 30 and sum("straggler/max_score" in r for r in records) == 30 // INTERVAL
    assert _named(records) is None, _named(records)
