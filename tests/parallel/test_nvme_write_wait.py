"""NVMe-offloaded AdamW: `step()` returns only once every write of the step's states is on disk (checkpoints and
the next step read the file). Deterministic, not timed: every pwritev is held at a gate that opens only when the
step asks for a write's result, so a step that stopped waiting for its writes returns with nothing written."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import framework.parallel.offload as offload
from framework.parallel.offload import NVMeAdamW, NVMeOffloadConfig


class _AskedFuture:
    """A write's future whose `result()` first opens the gate the write is held at."""

    def __init__(self, inner: Future[Any], gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def result(self, timeout: float | None = None) -> Any:
        self.gate.set()
        return self.inner.result(timeout)


def test_step_returns_after_its_writes_and_states_equal_in_memory_adamw(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (700, 300, 1000)]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    # 2,000 elements x 8 state bytes in groups of ~0.005 MiB: 4 groups, 8 buffers (no buffer is ever reused, so
    # nothing in the step waits on a write before its end)
    cfg = NVMeOffloadConfig(path=str(tmp_path), buffer_count=8, group_mb=0.005, overlap=True, pin_memory=False)
    opt = NVMeAdamW.wrap(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), cfg, torch.device("cpu"), "t")
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    assert len(opt.groups) >= 3 and len(opt.groups) <= cfg.buffer_count

    gate = threading.Event()
    real_pwritev = os.pwritev
    pool = opt._pool
    assert pool is not None
    real_submit = pool.submit

    def held_pwritev(fd: int, buffers: Any, offset: int) -> int:
        assert gate.wait(timeout=60), "the gate never opened"
        return real_pwritev(fd, buffers, offset)

    def submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
        fut = real_submit(fn, *args, **kwargs)
        return _AskedFuture(fut, gate) if getattr(fn, "__name__", "") == "_write" else fut

    monkeypatch.setattr(offload.os, "pwritev", held_pwritev)
    monkeypatch.setattr(pool, "submit", submit)
    try:
        for step in range(3):
            for p, r in zip(params, ref_params, strict=True):
                g = torch.randn_like(p)
                p.grad, r.grad = g.clone(), g.clone()
            gate.clear()
            written = opt.bytes_written
            opt.step()
            # without the end-of-step wait the gate is still shut here and nothing of this step is written
            assert gate.is_set(), f"step {step} returned without waiting for its writes"
            assert opt.bytes_written - written == opt.numel * 8
            ref.step()
            for p, r in zip(params, ref_params, strict=True):
                assert torch.equal(p, r)
    finally:
        gate.set()  # let held writes finish whatever happened
    sd = opt.state_dict()["state"]
    for i, r in enumerate(ref_params):  # the file holds exactly in-memory AdamW's states
        assert torch.equal(sd[i]["exp_avg"], ref.state[r]["exp_avg"])
        assert torch.equal(sd[i]["exp_avg_sq"], ref.state[r]["exp_avg_sq"])
    opt.close()
