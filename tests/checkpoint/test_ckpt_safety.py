"""Checkpoints are never destroyed by a restart: refuse when none verifies, move aside on purpose, prune only what
the newest commit superseded, verify by size when xxhash is missing (one process, the real trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.base.errors import CheckpointError
from framework.checkpoint import dcp, manifest
from framework.checkpoint.dcp import prune_checkpoints
from framework.testing.tiny import TINY, tiny_config
from framework.train.trainer import Trainer


def _cfg(run: Path, *extra: str):  # type: ignore[no-untyped-def]
    return tiny_config(run, *["train.steps=6", "checkpoint.interval=2", "checkpoint.keep_last=2",
                              "train.eval_interval=0", *extra])


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_unverifiable_checkpoints_refuse_then_move_aside(tmp_path: Path) -> None:
    run = tmp_path / "run"
    Trainer(_cfg(run)).train()
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_4", "step_6"]
    for shard in ckpts.glob("step_*/*.distcp"):  # a shared filesystem lost the tails of every shard
        shard.write_bytes(shard.read_bytes()[:64])
    before = _snapshot(ckpts)
    for _ in range(2):  # a requeued job does not wear the checkpoints down either
        with pytest.raises(CheckpointError) as err:
            Trainer(_cfg(run, "train.steps=8")).train()
        text = str(err.value)
        assert "step_6: " in text and "step_4: " in text and "truncated" in text
        assert "checkpoint.start_over=true" in text
        assert _snapshot(ckpts) == before  # nothing deleted, nothing overwritten

    result = Trainer(_cfg(run, "checkpoint.start_over=true")).train()
    assert result.start_step == 0 and result.final_step == 6
    aside = [p for p in ckpts.iterdir() if p.name.startswith("invalid-")]
    assert len(aside) == 1
    assert _snapshot(aside[0]) == before
    assert (ckpts / "latest").read_text().strip() == "step_6"
    # A valid checkpoint exists again: start_over resumes it rather than starting over twice.
    again = Trainer(_cfg(run, "checkpoint.start_over=true", "train.steps=8", "checkpoint.steps_change=reshape")).train()
    assert again.start_step == 6 and len([p for p in ckpts.iterdir() if p.name.startswith("invalid-")]) == 1


def test_without_xxhash_verification_falls_back_to_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    Trainer(_cfg(run, "train.steps=4")).train(stop_at=2)
    monkeypatch.setattr(manifest, "xxhash", None)  # a minimal install
    result = Trainer(_cfg(run, "train.steps=4")).train()
    assert result.start_step == 2 and "verifying file sizes only" in (run / "train.log").read_text()
    shard = next((run / "checkpoints/step_4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="truncated"):  # sizes still catch truncation
        manifest.verify_manifest(run / "checkpoints/step_4")


def test_prune_only_what_the_new_commit_superseded(tmp_path: Path) -> None:
    for s in (2, 4, 6, 10):
        (tmp_path / f"step_{s}").mkdir()
    # A run resumed from step_4 (step_6 and step_10 failed to verify) commits step_5: the later ones stay.
    (tmp_path / "step_5").mkdir()
    prune_checkpoints(tmp_path, keep_last=2, keep_every=0, newest=5)
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step_*")) == [4, 5, 6, 10]
    (tmp_path / "step_12").mkdir()
    prune_checkpoints(tmp_path, keep_last=2, keep_every=0, newest=12)
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step_*")) == [10, 12]


def test_a_commit_over_an_existing_step_moves_it_aside(tmp_path: Path) -> None:
    import torch

    for value in (1.0, 2.0):
        tmp = dcp.begin_save(tmp_path, 3)
        dcp.write_shards({"model": {"w": torch.full((2,), value)}}, tmp)
        dcp.commit(tmp_path, 3, {"value": value})
    assert dcp.read_meta(tmp_path / "step_3")["value"] == 2.0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and dcp.read_meta(aside[0] / "step_3")["value"] == 1.0


def test_guard_stops_a_persistent_divergence(tmp_path: Path) -> None:
    """train.lr=1000: the guard rolls back, the divergence returns, the run stops with DivergenceError (exit 2,
    not the requeue code) within a bounded number of steps, and metrics.jsonl says why."""
    from framework.cli import main

    run = tmp_path / "run"
    code = main(["train", str(TINY), f"run.dir={run}", "train.lr=1000", "train.steps=200", "checkpoint.interval=2",
                 "train.eval_interval=0", "checkpoint.guard.max_rollbacks=2"])
    assert code == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stops = [r for r in records if r["type"] == "guard_stop"]
    assert len(stops) == 1 and stops[0]["reason"] and len([r for r in records if r["type"] == "rollback"]) <= 2
    assert len([r for r in records if r["type"] == "train"]) < 30  # bounded: never the 200 steps
    latest = (run / "checkpoints/latest").read_text().strip()
    assert not dcp.read_meta(run / "checkpoints" / latest).get("guard_suspect")


def test_rollback_refusals_and_suspect_checkpoints(tmp_path: Path) -> None:
    import torch

    from framework.checkpoint.config import GuardConfig
    from framework.checkpoint.guard import LossGuard
    from framework.checkpoint.manager import find_valid_checkpoint

    guard = LossGuard(GuardConfig(max_rollbacks=2))
    assert guard.rollback_refusal("step_4") is None
    guard.rolled_back("step_4")
    assert "already happened" in (guard.rollback_refusal("step_4") or "")
    assert guard.rollback_refusal("step_6") is None
    guard.rolled_back("step_6")
    assert "max_rollbacks=2" in (guard.rollback_refusal("step_8") or "")
    clone = LossGuard(guard.cfg)
    clone.load_state_dict(guard.state_dict())
    assert clone.rollback_targets == {"step_4": 1, "step_6": 1}

    for step, suspect in ((2, False), (4, True)):
        tmp = dcp.begin_save(tmp_path, step)
        dcp.write_shards({"model": {"w": torch.ones(2)}}, tmp)
        dcp.commit(tmp_path, step, {"guard_suspect": suspect}, keep_last=1)
    assert (tmp_path / "latest").read_text().strip() == "step_2"  # not pruned, not replaced by the suspect one
    assert (tmp_path / "step_4").is_dir() and find_valid_checkpoint(tmp_path) == tmp_path / "step_2"
