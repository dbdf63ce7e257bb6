"""`tessera doctor` on run directories made by real injected faults: a rank stalled in a collective (the
watchdog dumps), memory growing, loss spikes the guard skips, a loader slowed for a few steps — and a healthy
run (stopped and resumed) with nothing wrong."""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.runtime import FaultTolerance
from framework.cli import main
from framework.config import load_config
from framework.observe.doctor import Finding, diagnose
from framework.testing import DistributedTestError, run_distributed
from framework.testing.tiny import TINY
from framework.train.trainer import Trainer

STEPS = ["train.steps=16", "train.warmup_steps=2", "checkpoint.interval=8", "train.eval_interval=0"]


def _problems(findings: list[Finding], noisy: bool = True) -> list[Finding]:
    """Warnings and errors; without `noisy`, throughput drops are left out: the tiny runs' ~0.1 s steps on a
    shared 2-core machine dip for a few steps whenever a neighbour starts (test_slowed_loader tests the drop)."""
    return [f for f in findings if f.level != "info" and (noisy or f.topic != "throughput")]


def _trainer(run: Path, *overrides: str) -> Trainer:
    torch.set_num_threads(1)
    return Trainer(load_config(TINY, [f"run.dir={run}", *STEPS, *overrides]))


def _stall_rank1_in_loader(rank: int, world: int, run: Path) -> None:
    cfg = CheckpointConfig(watchdog_timeout_s=3.0, collective_timeout_s=120.0, handle_signals=False)
    ft = FaultTolerance(cfg, run, torch.device("cpu"))
    with ft.running():
        for step in range(1, 1000):
            if rank == 1 and step == 4:
                read_a_stuck_shard()
            dist.all_reduce(torch.ones(1))
            ft.step_done(step)


def read_a_stuck_shard() -> None:
    time.sleep(3600)


@pytest.mark.distributed
def test_hang_names_the_rank_behind_and_the_collective(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError):
        run_distributed(_stall_rank1_in_loader, 2, timeout_s=90, run=tmp_path)
    (hang,) = [f for f in diagnose(tmp_path) if f.topic == "hang"]
    assert hang.level == "error"
    assert "rank 1 (read_a_stuck_shard" in hang.summary and "all_reduce" in hang.summary, hang
    assert any("rank 0: last completed step 3" in e and "waiting in all_reduce" in e for e in hang.evidence)


def _leaky_run(rank: int, world: int, run: Path) -> None:
    trainer = _trainer(run)
    kept: list[torch.Tensor] = []
    real = trainer.engine.forward_backward

    def leaking(batch: torch.Tensor) -> float:
        kept.append(torch.ones(24 * 2**20 // 4))  # 24 MiB kept alive every step, as a logging bug would
        return real(batch)

    trainer.engine.forward_backward = leaking  # type: ignore[method-assign]
    trainer.train()


def test_memory_growth(tmp_path: Path) -> None:
    run_distributed(_leaky_run, 1, timeout_s=300, run=tmp_path)  # a fresh process: its peak RSS starts low
    found = _problems(diagnose(tmp_path), noisy=False)
    assert [f.topic for f in found] == ["memory"], found
    assert "memory grows across steps" in found[0].summary


def test_loss_spikes_skipped_by_the_guard(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "checkpoint.guard.min_history=5")
    real = trainer.engine.forward_backward
    head = trainer.engine.model_parts[0].output.weight  # type: ignore[union-attr]

    def spiking(batch: torch.Tensor) -> float:
        if trainer.step + 1 not in (10, 13):
            return real(batch)
        with torch.no_grad():
            head.mul_(40.0)  # a real forward/backward through blown-up logits
        try:
            return real(batch)
        finally:
            with torch.no_grad():
                head.div_(40.0)

    trainer.engine.forward_backward = spiking  # type: ignore[method-assign]
    trainer.train()
    found = _problems(diagnose(tmp_path), noisy=False)
    assert [f.topic for f in found] == ["loss"], found
    assert "2 loss spike(s) skipped by the guard" in found[0].summary
    assert [e.split(":")[0] for e in found[0].evidence] == ["step 10", "step 13"]


def test_slowed_loader(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    real = trainer.loader.next_batch

    def slow() -> Any:
        if 8 <= trainer.step + 1 <= 11:
            time.sleep(1.0)  # a filesystem stall for four steps
        return real()

    trainer.loader.next_batch = slow  # type: ignore[method-assign]
    trainer.train()
    found = _problems(diagnose(tmp_path))
    assert {f.topic for f in found} == {"data", "throughput"}, found
    drop = next(f for f in found if f.topic == "throughput" and "steps 8-11" in f.summary)
    assert "steps 8-11" in drop.summary and "data_time_s rose" in drop.evidence[0]


def test_healthy_run_stopped_and_resumed_reports_nothing_wrong(tmp_path: Path) -> None:
    _trainer(tmp_path).train(stop_at=8)
    _trainer(tmp_path).train()
    findings = [f for f in diagnose(tmp_path, checksums=True) if f.topic != "throughput"]
    assert not _problems(findings), findings
    assert [f.topic for f in findings] == ["resume"] and "step_8" in findings[0].summary
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["doctor", str(tmp_path)])
    assert code == 0 or "[warning] throughput" in out.getvalue(), out.getvalue()
    (tmp_path / "checkpoints" / "step_16" / "meta.json").write_text("{}")  # a damaged checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["doctor", str(tmp_path)]) == 1
    assert [f.topic for f in _problems(diagnose(tmp_path), noisy=False)] == ["checkpoint"]


def test_damaged_metrics_an_empty_directory_and_a_ctrl_c_stop(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _trainer(run, "train.steps=6").train()
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    # What other writers and disks leave in a metrics file: an array, a step that is not a number, binary bytes,
    # and a last line cut by a kill.
    metrics.write_bytes(b"".join([lines[0], b'[1, 2, 3]\n', b'{"type": "train", "step": "seven", "loss": 1}\n',
                                  b"\x00\x89PNG\xff\xfe\x00" * 20 + b"\n", *lines[1:], lines[-1][:20]]))
    (run / "train.log").write_text((run / "train.log").read_text() + "12:00:00 [WARNING] stopping at step 6 on "
                                   "SIGINT: checkpoint committed; exit code 130 (interrupted: not requeued); run "
                                   "the same command again to resume\n")
    findings = diagnose(run)
    damaged = next(f for f in findings if f.topic == "metrics")
    assert damaged.level == "warning" and len(damaged.evidence) == 4, damaged
    assert "step 'seven' is not a whole number" in damaged.evidence[1] and "not a JSON object" in damaged.evidence[0]
    assert "(the last line: cut by a kill)" in damaged.evidence[3]
    stop = next(f for f in findings if f.topic == "stop")
    assert "interrupted (Ctrl-C) at step 6" in stop.summary and stop.level == "info"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["doctor", str(run)]) == 1
    assert "6 train records, last step 6" in out.getvalue()
    empty = tmp_path / "empty"
    empty.mkdir()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["doctor", str(empty)]) == 1
    assert "holds no run" in out.getvalue() and "no problems found" not in out.getvalue()
