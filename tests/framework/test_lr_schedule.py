"""LR schedules: warmup, cosine, WSD, linear — at the points that define them."""

from __future__ import annotations

import math

import pytest

from framework.train.config import TrainConfig
from framework.train.lr_schedule import lr_at


def test_warmup_then_cosine() -> None:
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(cfg, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 59) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(cfg, 109) == pytest.approx(0.1)


def test_wsd() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(cfg, 50) == 1.0 and lr_at(cfg, 79) == 1.0
    assert lr_at(cfg, 89) == pytest.approx(0.5)
    assert lr_at(cfg, 99) == pytest.approx(0.0)


def test_linear_and_constant() -> None:
    lin = TrainConfig(steps=10, warmup_steps=0, lr=1.0, min_lr_ratio=0.0, schedule="linear")
    assert [round(lr_at(lin, s), 6) for s in (0, 4, 9)] == [0.9, 0.5, 0.0]
    const = TrainConfig(steps=10, warmup_steps=2, lr=2.0, schedule="constant")
    assert lr_at(const, 0) == 1.0 and lr_at(const, 9) == 2.0
