"""Swarm reuse: an earlier swarm over (code, prose, web) re-enters the fit of a swarm over (code, prose, tests) — web
dropped, tests added — for the domains it evaluated, against a planted own-weight law with known coefficients."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from framework.base.errors import ConfigError
from framework.drivers.ablate_fit import LOG_EPS, fit
from framework.drivers.ablate_reuse import earlier_rows
from framework.drivers.ablate_surrogate import parametric

A = {"code": 3.0, "prose": 4.0, "tests": 2.5, "web": 3.5}
B = {"code": -0.2, "prose": -0.4, "tests": -0.25, "web": -0.3}
NOW = ["code", "prose", "tests"]
VAL = {"code": 100, "prose": 50, "tests": 80, "web": 70}


def _loss(w: dict[str, float], s: str, rng: np.random.Generator) -> float:
    return A[s] + B[s] * np.log(w.get(s, 0.0) + LOG_EPS) + rng.normal(0, 0.01)


def _write(root: Path, weights: list[dict[str, float]], rng: np.random.Generator, tok: str = "/b/tok.model") -> None:
    for i, w in enumerate(weights):
        for seed in (0, 1):
            run = root / "runs" / f"m{i:02d}-s{seed}"
            run.mkdir(parents=True)
            run.joinpath("result.json").write_text(json.dumps({
                "mixture_id": f"m{i:02d}", "seed": seed, "weights": w, "tokenizer_path": tok,
                "val": {f"val_loss/{s}": _loss(w, s, rng) for s in w}, "val_samples": {s: VAL[s] for s in w}}))


def test_an_earlier_swarm_with_a_dropped_and_an_added_source_joins_the_fits(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    old = [dict(zip(["code", "prose", "web"], w, strict=True)) for w in rng.dirichlet([2, 2, 2], 19)]
    old.append({"code": 0.6, "prose": 0.4, "web": 0.0})  # read no web: a point of the current simplex too
    _write(tmp_path / "earlier", old, rng)
    We, Le, labels = earlier_rows([str(tmp_path / "earlier")], NOW, "/b/tok.model", VAL)
    assert len(labels) == 20 and We.shape == Le.shape == (20, 3)
    # Weights as they were: tests 0 (not mixed then), web's share is no current weight; tests is a hole, not 0.
    np.testing.assert_allclose(We[:, :2], [[w["code"], w["prose"]] for w in old])
    assert (We[:, 2] == 0).all() and np.isnan(Le[:, 2]).all() and np.isfinite(Le[:, :2]).all()
    np.testing.assert_allclose(We.sum(axis=1), [1 - w["web"] for w in old])
    # This swarm: 4 mixtures over (code, prose, tests), few for 2-parameter laws. Over 40 such swarms the earlier
    # rows bring the code and prose slopes much closer to the planted ones; tests is fitted on this swarm alone.
    err_alone, err_joined = [], []
    for _ in range(40):
        Wn = rng.dirichlet([2, 2, 2], 4)
        Ln = np.array([[_loss(dict(zip(NOW, w, strict=True)), s, rng) for s in NOW] for w in Wn])
        alone, joined = fit(Wn, Ln, "log_linear"), fit(np.vstack([Wn, We]), np.vstack([Ln, Le]), "log_linear")
        err_alone.append([abs(alone.coefs[d][1] - B[s]) for d, s in enumerate(NOW[:2])])
        err_joined.append([abs(joined.coefs[d][1] - B[s]) for d, s in enumerate(NOW[:2])])
        np.testing.assert_array_equal(joined.coefs[2], alone.coefs[2])
    assert (np.mean(err_joined, axis=0) < 0.5 * np.mean(err_alone, axis=0)).all(), (err_joined, err_alone)
    assert np.max(err_joined) < 0.02
    # The linear model takes only rows on this simplex: the one earlier mixture without web.
    lin = fit(np.vstack([Wn, We]), np.vstack([Ln, Le]), "linear")
    ref = fit(np.vstack([Wn, We[-1:]]), np.vstack([Ln, Le[-1:]]), "linear")
    for d in range(2):
        np.testing.assert_allclose(lin.coefs[d], ref.coefs[d], rtol=1e-10, atol=1e-12)
    # The surrogate's leave-one-out error stays on this swarm's 4 mixtures.
    sur = parametric(Wn, Ln, NOW, "mean", "log_linear", (We, Le))
    assert sur.loo_pred.shape == (4,) and np.isfinite(sur.loo_rmse)
    # Losses from another tokenizer or other held-out documents are not comparable.
    _write(tmp_path / "other", old[:1], rng, tok="/c/tok.model")
    with pytest.raises(ConfigError, match=r"read the tokenizer /c/tok\.model"):
        earlier_rows([str(tmp_path / "other")], NOW, "/b/tok.model", VAL)
    with pytest.raises(ConfigError, match="held out"):
        earlier_rows([str(tmp_path / "earlier")], NOW, "/b/tok.model", {**VAL, "code": 99})
