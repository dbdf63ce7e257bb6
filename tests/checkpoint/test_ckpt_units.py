"""Checkpoint building blocks without a trainer: manifest, safe unpickling, compatibility, guard, pruning."""

from __future__ import annotations

import io
import math
import os
import pickle
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from framework.base.errors import CheckpointError, ConfigError
from framework.checkpoint import REQUEUE_EXIT_CODE
from framework.checkpoint.async_save import AsyncSaver
from framework.checkpoint.config import CheckpointConfig, GuardConfig
from framework.checkpoint.dcp import candidates, load_state, prune_checkpoints, write_latest, write_shards
from framework.checkpoint.guard import LossGuard
from framework.checkpoint.manager import check_compatible, find_valid_checkpoint
from framework.checkpoint.manifest import verify_manifest, write_manifest
from framework.checkpoint.signals import StopSignals
from framework.checkpoint.storage import read_dcp_metadata


def _fake_ckpt(root: Path, step: int) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(f'{{"step": {step}}}')
    (d / "__0_0.distcp").write_bytes(os.urandom(4096))
    write_manifest(d)
    return d


def test_requeue_code_is_documented_default() -> None:
    assert REQUEUE_EXIT_CODE == 42 == CheckpointConfig().requeue_exit_code


def test_manifest_detects_truncation_and_corruption(tmp_path: Path) -> None:
    d = _fake_ckpt(tmp_path, 3)
    verify_manifest(d)
    shard = d / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has 100 bytes, the manifest records 4096"):
        verify_manifest(d)
    verify_manifest(d, "none")
    shard.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, one flipped bit
    verify_manifest(d, "size")
    with pytest.raises(CheckpointError, match="checksum"):
        verify_manifest(d, "checksum")
    (d / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="never committed"):
        verify_manifest(d)


def test_fallback_to_previous_valid_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for s in (2, 4, 6):
        _fake_ckpt(tmp_path, s)
    write_latest(tmp_path, "step_6")
    assert [p.name for p in candidates(tmp_path)] == ["step_6", "step_4", "step_2"]
    (tmp_path / "step_6" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "step_4" / "manifest.json").unlink()
    with caplog.at_level("WARNING", logger="tessera"):
        assert find_valid_checkpoint(tmp_path) == tmp_path / "step_2"
    text = caplog.text
    assert "skipping checkpoint step_6" in text and "truncated" in text and "skipping checkpoint step_4" in text


def test_prune_keeps_last_and_every(tmp_path: Path) -> None:
    for s in range(1, 11):
        (tmp_path / f"step_{s}").mkdir()
    prune_checkpoints(tmp_path, keep_last=2, keep_every=4)
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step_*")) == [4, 8, 9, 10]


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_metadata_unpickler_refuses_code(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"references posix.system|references os.system"):
        read_dcp_metadata(io.BytesIO(pickle.dumps(_Evil())))
    # A real DCP checkpoint (with a non-tensor value) loads through the safe reader and planner.
    state = {"w": torch.arange(6.0).view(2, 3), "extra": {"lr": 0.5, "betas": (0.9, 0.95)}}
    write_shards(state, tmp_path / "c")
    target = {"w": torch.zeros(2, 3), "extra": {"lr": 0.0, "betas": (0.0, 0.0)}}
    load_state(tmp_path / "c", target)
    assert torch.equal(target["w"], state["w"]) and target["extra"] == {"lr": 0.5, "betas": (0.9, 0.95)}


def test_compatibility_names_the_field() -> None:
    saved = {"config": {"model": {"hidden": 64, "n_layers": 4, "preset": "a"}, "data": {"seed": 1}},
             "data_fingerprint": "aaa"}
    same = {"model": {"hidden": 64, "n_layers": 4, "preset": "b"}, "data": {"seed": 1}}
    assert check_compatible(saved, same, "aaa") == []
    wider = {"model": {"hidden": 128, "n_layers": 4}, "data": {"seed": 1}}
    with pytest.raises(CheckpointError, match=r"model.hidden is 128 in this run but 64 .*allow_model_change"):
        check_compatible(saved, wider, "aaa")
    assert check_compatible(saved, wider, "aaa", allow_model_change=True) == ["model.hidden: 64 -> 128"]
    reseeded = {"model": same["model"], "data": {"seed": 2}}
    with pytest.raises(CheckpointError, match=r"data fingerprint .*data.seed: 1 -> 2.*allow_data_change"):
        check_compatible(saved, reseeded, "bbb")
    assert len(check_compatible(saved, reseeded, "bbb", allow_data_change=True)) == 1


def test_guard_skips_nonfinite_and_spikes_then_asks_for_rollback() -> None:
    g = LossGuard(GuardConfig(zscore=4.0, window=8, min_history=4, max_consecutive=2))
    for i in range(6):
        assert not g.check(5.0 + 0.01 * (i % 3), 1.0).skip
    assert g.check(float("nan"), 1.0).reason == "nonfinite_loss"
    assert not g.rollback_due
    assert g.check(5.0, math.inf).reason == "nonfinite_grad"
    assert g.rollback_due and g.skipped_total == 2
    g.rolled_back()
    v = g.check(9.0, 1.0)
    assert v.reason == "spike" and v.zscore > 4.0
    assert not g.check(5.02, 1.0).skip and g.consecutive == 0
    clone = LossGuard(g.cfg)
    clone.load_state_dict(g.state_dict())
    assert clone.state_dict() == g.state_dict() and clone.zscore(6.0) == g.zscore(6.0)


def test_config_validation_messages() -> None:
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        CheckpointConfig(watchdog_timeout_s=60, collective_timeout_s=30).validate()
    with pytest.raises(ConfigError, match="min_history"):
        GuardConfig(window=4, min_history=8).validate()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signals_set_the_flag_and_restore_handlers(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    stop = StopSignals().install()
    assert not stop.agreed_stop()
    os.kill(os.getpid(), sig)  # delivered to the main thread before the next bytecode
    assert stop.agreed_stop() and stop.signal_name == sig.name
    stop.restore()
    assert signal.getsignal(sig) == before


def test_async_save_commits_in_background_and_surfaces_errors(tmp_path: Path) -> None:
    saver = AsyncSaver(pg=None)
    live = {"model": {"w": torch.ones(3)}}
    saver.save(tmp_path, 1, live, {"note": "ok"}, keep_last=2, keep_every=0)
    live["model"]["w"].add_(1)  # training goes on: the staged copy is what gets written
    assert saver.wait() == 1
    assert (tmp_path / "latest").read_text().strip() == "step_1"
    verify_manifest(tmp_path / "step_1")
    target = {"model": {"w": torch.zeros(3)}}
    load_state(tmp_path / "step_1", target)
    assert torch.equal(target["model"]["w"], torch.ones(3))
    saver.save(tmp_path, 2, {"model": {"w": torch.ones(3)}, "bad": lambda: 0}, {}, keep_last=2, keep_every=0)
    with pytest.raises(CheckpointError, match="asynchronous checkpoint save failed"):
        saver.wait()
    assert (tmp_path / "latest").read_text().strip() == "step_1" and not (tmp_path / "step_2").exists()


def _training_like_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {"model": {"w": torch.randn(37, 11, generator=gen), "h": torch.randn(64, generator=gen).bfloat16()},
            "optim": {"state": [{"step": torch.tensor(7.0), "exp_avg": torch.randn(37, 11, generator=gen)}],
                      "lr": 3e-4},
            "empty": torch.zeros(0, 5)}


@pytest.mark.parametrize("budget", [1 << 20, 100])  # everything fits / bucketed through a 100-byte bounce buffer
def test_host_staging_copies_to_reused_host_buffers(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """Staged tensors are host copies (no aliasing, bitwise equal), the same buffers at the next save; pinning is
    asked for only where it exists (here: never, no CUDA runtime)."""
    from framework.checkpoint import staging

    requests: list[bool] = []
    real = staging.host_empty
    monkeypatch.setattr(staging, "host_empty",
                        lambda shape, dtype, pin: requests.append(pin) or real(shape, dtype, pin))
    live = _training_like_state()
    stager = staging.HostStager(budget)
    first = stager.stage(live)
    leaves = staging._leaves(first)
    assert [p for p, _ in leaves] == [p for p, _ in staging._leaves(live)]
    for (_, got), (_, want) in zip(leaves, staging._leaves(live), strict=True):
        assert got.device.type == "cpu" and got.dtype == want.dtype and torch.equal(got, want)
        assert got.numel() == 0 or got.data_ptr() != want.data_ptr()
        assert got.is_pinned() == staging.pin_available()
    assert first["optim"]["lr"] == 3e-4
    assert requests and not any(requests) and not torch.cuda.is_available()
    assert stager.host_bytes == staging.state_bytes(live) + (budget if budget < staging.state_bytes(live) else 0)
    for _, t in staging._leaves(live):
        t.add_(1) if t.dtype != torch.bool else None  # training goes on
    second = stager.stage(live)
    for (_, a), (_, b), (_, now) in zip(leaves, staging._leaves(second), staging._leaves(live), strict=True):
        assert a.data_ptr() == b.data_ptr() and torch.equal(b, now)  # reused, refreshed


def test_host_staging_pins_where_cuda_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake CUDA (pin_available and the allocation monkeypatched; nothing else reaches the pinned branch on a CPU
    machine): a state that fits asks for pinned buffers; a larger one pageable destinations and one pinned
    bounce buffer of the budget's size."""
    from framework.checkpoint import staging

    requests: list[tuple[tuple[int, ...], bool]] = []
    monkeypatch.setattr(staging, "pin_available", lambda: True)
    monkeypatch.setattr(staging, "host_empty",
                        lambda shape, dtype, pin: requests.append((shape, pin)) or torch.empty(shape, dtype=dtype))
    live = _training_like_state()
    staging.HostStager(1 << 20).stage(live)
    assert requests and all(pin for _, pin in requests)
    requests.clear()
    staging.HostStager(256).stage(live)
    assert requests[-1] == ((256,), True) and not any(pin for _, pin in requests[:-1])


def test_async_writer_thread_selects_the_ranks_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake CUDA (the current device and torch.cuda.set_device monkeypatched): no CPU path reaches the selection.
    The training thread computes on cuda:3; the writer thread must make cuda:3 current before writing."""
    import threading

    from framework.checkpoint import async_save

    selected: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(async_save, "current_accelerator", lambda: torch.device("cuda", 3))
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: selected.append((threading.current_thread().name, torch.device(d))))
    saver = AsyncSaver(pg=None, pin_budget_bytes=100)
    live = _training_like_state()
    saver.save(tmp_path, 1, live, {}, keep_last=2, keep_every=0)
    want = {"model": {k: v.clone() for k, v in live["model"].items()}}
    live["model"]["w"].mul_(3)  # training goes on while the thread writes
    assert saver.wait() == 1
    assert selected == [("tessera-ckpt-step1", torch.device("cuda", 3))]
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
    load_state(tmp_path / "step_1", target)
    for k, v in want["model"].items():
        assert torch.equal(target["model"][k], v), k  # bitwise what was live at the save
