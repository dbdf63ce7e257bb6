"""Online data mixing (`data.mixing: online`).

- The rule against DoReMi's Algorithm 1 written out with numpy (Xie et al. 2023), and the rounding that makes
  world sizes agree.
- Errors at config load and at trainer start.
- The trainer on the stdlib corpus: a run stopped and resumed reads bitwise what the uninterrupted run read (losses,
  weights, held-out losses), on one process and on 2 data ranks; 1 and 2 data ranks follow the same weight
  trajectory. One 2-rank spawn hosts both 2-rank runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_pipeline.read.doremi import doremi_update
from framework.base.errors import ConfigError, DataError
from framework.observe.plot import read_weights
from framework.testing import run_distributed
from framework.testing.tiny import tiny_config
from framework.train.trainer import Trainer

ONLINE = ("data.mixing=online", "data.online.interval=2", "data.online.eval_samples=4", "data.online.step_size=10",
          "train.steps=8", "checkpoint.interval=0", "train.warmup_steps=2")


def _doremi_paper(alpha: np.ndarray, losses: np.ndarray, ref: np.ndarray, eta: float, c: float) -> np.ndarray:
    """Algorithm 1 of arXiv:2305.10429 as printed: alpha' = alpha exp(eta lambda), alpha = (1-c) alpha'/sum + c u."""
    lam = np.maximum(losses - ref, 0.0)
    a = alpha * np.exp(eta * lam)
    return (1 - c) * a / a.sum() + c / len(alpha)


def test_rule_matches_the_paper_and_rounding_absorbs_reduction_noise() -> None:
    rng = np.random.default_rng(3)
    names = ["code", "prose", "tests", "web"]
    for _ in range(50):
        w = rng.dirichlet(np.ones(4))
        losses = np.round(rng.uniform(2, 9, 4), 3)  # on the 1e-3 grid already
        ref = rng.uniform(2, 9, 4)
        eta, c = float(rng.uniform(0.1, 2)), float(rng.uniform(0, 0.1))
        got = doremi_update(dict(zip(names, w, strict=True)), dict(zip(names, losses, strict=True)),
                            reference=dict(zip(names, ref, strict=True)), step_size=eta, smoothing=c, round_to=1e-3)
        np.testing.assert_allclose([got.weights[n] for n in names], _doremi_paper(w, losses, ref, eta, c),
                                   rtol=1e-12, atol=1e-15)
        assert abs(sum(got.weights.values()) - 1) < 1e-12
    # A missing reference is 0; a huge excess saturates instead of overflowing.
    big = doremi_update({"a": 0.5, "b": 0.5}, {"a": 900.0, "b": 1.0}, reference={}, step_size=1.0,
                        smoothing=0.1, round_to=1e-3)
    assert big.weights == pytest.approx({"a": 0.95, "b": 0.05}, abs=1e-12)
    # Two world sizes' losses differ in the last bits of their sums: the same weights, bitwise.
    base = {"a": 0.2, "b": 0.3, "c": 0.5}
    kw: dict[str, Any] = {"reference": {}, "step_size": 1.0, "smoothing": 1e-3, "round_to": 1e-3}
    one = doremi_update(base, {"a": 6.1234, "b": 5.0002, "c": 7.25}, **kw)
    two = doremi_update(base, {"a": 6.1234 + 4e-7, "b": 5.0002 - 3e-7, "c": 7.25 + 1e-7}, **kw)
    assert one.weights == two.weights
    assert doremi_update(base, {"a": 6.1254, "b": 5.0002, "c": 7.25}, **kw).weights != one.weights
    with pytest.raises(DataError, match="not finite"):
        doremi_update(base, {"a": float("nan"), "b": 1.0, "c": 1.0}, **kw)


def _data(stdlib_build: Any) -> list[str]:
    return ["data.kind=stdlib", f"data.cache_dir={stdlib_build.cfg.cache_dir}", "model.vocab_size=4096"]


def test_online_settings_are_checked_at_load_and_at_start(stdlib_build: Any, tmp_path: Path) -> None:
    data = _data(stdlib_build)
    for bad, words in [
            (["data.kind=synthetic"], "two or more sources"),
            (["data.weights={code: 1.0}"], "two or more sources"),
            (["data.max_epochs={prose: 2}"], "not combined with data.max_epochs"),
            (["data.schedule=[{start_step: 4, weights: {code: 1.0}}]"], "not combined with data.schedule"),
            (["data.online.reference={web: 2.0}"], "names ['web'], which are not mixed sources"),
            (["data.online.smoothing=1.0"], "must be in [0, 1)"),
            (["data.online.interval=0"], "must be >= 1")]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            tiny_config(tmp_path / "r", *data, *ONLINE, *bad)
    with pytest.raises(ConfigError, match=re.escape("multiple of train.micro_batch_size x data-parallel size = 2 x "
                                                    "1; set it to e.g. 4")):
        Trainer(tiny_config(tmp_path / "r", *data, *ONLINE, "data.online.eval_samples=3"))
    with pytest.raises(ConfigError, match=re.escape("set data.num_samples >= 64")):
        Trainer(tiny_config(tmp_path / "r", *data, *ONLINE, "data.num_samples=40"))


def _records(run: Path) -> tuple[dict[int, float], list[dict[str, Any]], list[dict[str, float]]]:
    """Train losses by step, the mixing records, and the weights every train record logged."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["type"] == "train"]
    return ({r["step"]: r["loss"] for r in train}, [r for r in recs if r["type"] == "mixing"],
            [{k: v for k, v in r.items() if k.startswith("mix/")} for r in train])


def _stop_and_resume(run: Path, overrides: list[str], stop_at: int) -> None:
    Trainer(tiny_config(run, *overrides)).train(stop_at=stop_at)
    Trainer(tiny_config(run, *overrides)).train()


def _two_ranks(rank: int, world: int, root: Path, overrides: list[str]) -> None:
    Trainer(tiny_config(root / "full2", *overrides)).train()
    _stop_and_resume(root / "cut2", overrides, stop_at=5)  # a checkpoint between two updates


@pytest.mark.distributed
def test_stop_resume_bitwise_and_one_trajectory_on_one_and_two_data_ranks(
        stdlib_build: Any, tmp_path: Path, one_thread: None) -> None:
    one = [*_data(stdlib_build), *ONLINE]
    run_distributed(_two_ranks, 2, timeout_s=300, root=tmp_path, overrides=[*one, "parallel.dp_shard=2"])
    Trainer(tiny_config(tmp_path / "full1", *one)).train()
    _stop_and_resume(tmp_path / "cut1", one, stop_at=4)  # saved right after an update
    full1, cut1 = _records(tmp_path / "full1"), _records(tmp_path / "cut1")
    full2, cut2 = _records(tmp_path / "full2"), _records(tmp_path / "cut2")
    assert sorted(full1[0]) == list(range(1, 9)) and [r["step"] for r in full1[1]] == [2, 4, 6, 8]
    assert cut1 == full1  # losses, updates and per-step weights, bitwise
    assert cut2 == full2
    # 1 and 2 data ranks: the same rounded held-out losses, so the same weights, bitwise, at every step.
    assert full2[1] == full1[1] and full2[2] == full1[2]
    np.testing.assert_allclose([full2[0][s] for s in range(1, 9)], [full1[0][s] for s in range(1, 9)], atol=1e-4)
    first, last = full1[2][0], full1[2][-1]
    assert max(abs(first[k] - last[k]) for k in first) > 0.05, (first, last)  # the weights did move
    # `tessera plot RUN --weights` reads the same series back.
    from framework.cli import main

    assert main(["plot", str(tmp_path / "full1"), "--weights", "--out", str(tmp_path / "w.png")]) == 0
    assert (tmp_path / "w.png").stat().st_size > 10_000
    mw = read_weights(tmp_path / "full1")
    assert mw.steps == list(range(1, 9)) and mw.update_steps == [2, 4, 6, 8]
    assert [{f"mix/{n}": mw.weights[n][i] for n in mw.weights} for i in range(8)] == full1[2]
