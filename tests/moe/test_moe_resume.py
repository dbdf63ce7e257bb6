"""An MoE run resumed from its checkpoint continues bitwise as the uninterrupted run: the routing bias
(auxiliary-loss-free balancing state) is a persistent buffer and travels with the checkpoint; MoE metrics reach
metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework.config import Config
from framework.testing.tiny import tiny_config
from framework.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(run: Path) -> Config:
    return tiny_config(run, *["model.preset=test-moe", "model.n_layers=2", "train.steps=7",
                              "checkpoint.interval=3", "model.moe.bias_update_rate=0.001",
                              "model.moe.capacity_factor=1.0", "model.moe.z_loss_coef=0.001"])


def _records(run: Path) -> dict[int, dict[str, float]]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "train":
            out[rec["step"]] = rec
    return out


@pytest.mark.slow
def test_moe_resume_is_exact_and_metrics_are_logged(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    full = Trainer(_cfg(ref))
    full.train()
    Trainer(_cfg(run)).train(stop_at=3)
    resumed = Trainer(_cfg(run))
    resumed.train()
    a, b = _records(ref), _records(run)
    assert [a[s]["loss"] for s in range(1, 8)] == [b[s]["loss"] for s in range(1, 8)]
    assert [a[s]["moe/aux_loss"] for s in range(1, 8)] == [b[s]["moe/aux_loss"] for s in range(1, 8)]
    for key in ("moe/layers.0/imbalance", "moe/layers.1/dropped_frac", "moe/layers.1/tokens_e3", "moe/layers.0/z_loss"):
        assert key in b[7], key
    bias_ref = full.engine.model.layers["1"].feed_forward.router.expert_bias  # type: ignore[attr-defined]
    bias_run = resumed.engine.model.layers["1"].feed_forward.router.expert_bias  # type: ignore[attr-defined]
    assert bool((bias_ref != 0).all())  # 7 updates of +-rate each: never 0
    assert torch.equal(bias_ref, bias_run)
