"""The trainer hook: MFU fields on train records, perplexities on eval records, the summary record."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from framework.config import load_config
from framework.observe.observer import Observer
from framework.testing.tiny import TINY
from models.flops import flops_per_token


def _record(step: int, dt: float) -> dict:
    return {"type": "train", "step": step, "loss": 5.0 / step, "tokens": step * 256, "tokens_per_s": 256 / dt,
            "step_time_s": dt, "data_time_s": 0.1 * dt, "fwd_bwd_time_s": 0.7 * dt, "optim_time_s": 0.2 * dt,
            "memory_mb": 100.0 + step}


def test_observer_fields_and_summary(tmp_path: Path) -> None:
    cfg = load_config(TINY, ["observe.peak_tflops=0.5"])
    obs = Observer.for_config(cfg, tmp_path, rank=0, world=2, device=torch.device("cpu"))
    assert obs.sinks == []  # wandb/TensorBoard are off by default
    recs = [_record(1, 2.0), _record(2, 0.5), _record(3, 0.25)]
    extra = [obs.on_step(r) for r in recs]
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    assert extra[1]["tokens_per_s_per_device"] == pytest.approx(256)
    assert extra[1]["mfu"] == pytest.approx(256 * fpt / 0.5e12)

    ev = {"val_loss/code": 2.0, "val_loss/mean": 3.0}
    assert Observer.eval_metrics(ev) == {"val_ppl/code": pytest.approx(math.exp(2.0)),
                                         "val_ppl/mean": pytest.approx(math.exp(3.0))}
    summary = obs.summary(3, ev, checkpoint_time_s=0.125)
    assert summary["type"] == "summary" and summary["step"] == 3 and summary["final_loss"] == recs[-1]["loss"]
    # Steady state excludes step 1: mean of 0.5 s and 0.25 s.
    assert summary["mean_step_time_s"] == pytest.approx(0.375)
    assert summary["mean_fwd_bwd_time_s"] == pytest.approx(0.7 * 0.375)
    assert summary["tokens_per_s"] == pytest.approx(256 / 0.375)
    assert summary["mfu"] == pytest.approx(256 / 0.375 / 2 * fpt / 0.5e12)
    assert summary["peak_memory_mb"] == 103.0 and summary["checkpoint_time_s"] == 0.125
    assert summary["val_loss/code"] == 2.0
