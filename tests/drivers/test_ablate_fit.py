"""Pure parts of the ablation: mixture lists, the per-domain fit and its leave-one-out error, recommendation, Pareto."""

from __future__ import annotations

import numpy as np
import pytest

from framework.base.errors import ConfigError
from framework.drivers.ablate import AblationSpec, MixtureSpec, mixture_list, simplex_grid
from framework.drivers.ablate_fit import LOG_EPS, fit, pareto_mask, recommend

SOURCES = ["code", "prose", "tests"]


def _spec(**mix: object) -> AblationSpec:
    return AblationSpec(name="t", config="x.yaml", sources=SOURCES, token_budget=100,
                        mixtures=MixtureSpec(**mix))  # type: ignore[arg-type]


def test_simplex_grid_counts() -> None:
    g = simplex_grid(3, 0.25)
    assert len(g) == 15  # C(4 + 2, 2)
    np.testing.assert_allclose(g.sum(axis=1), 1.0)
    assert len(simplex_grid(4, 0.1)) == 286  # C(10 + 3, 3)


def test_mixture_list_explicit_grid_dirichlet() -> None:
    mixes = mixture_list(_spec(explicit=[{"code": 2, "prose": 1, "tests": 1}, {"code": 1, "prose": 0.5,
                                                                                "tests": 0.5}],
                               grid_step=0.25, grid_min=0.25, dirichlet=3, seed=7))
    assert mixes[0] == {"code": 0.5, "prose": 0.25, "tests": 0.25}
    # The second explicit mixture normalizes to the first and the grid's (0.5, 0.25, 0.25) too: deduplicated.
    grid = mixes[1:3]
    assert len(mixes) == 1 + 2 + 3 and all(min(m.values()) >= 0.25 for m in grid)
    assert mixes == mixture_list(_spec(explicit=[{"code": 2, "prose": 1, "tests": 1}, {"code": 1, "prose": 0.5,
                                                                                         "tests": 0.5}],
                                       grid_step=0.25, grid_min=0.25, dirichlet=3, seed=7))  # reproducible
    for m in mixes:
        assert sum(m.values()) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ConfigError, match="grid_step"):
        MixtureSpec(grid_step=0.3).validate()
    with pytest.raises(ConfigError, match="objective"):
        AblationSpec(name="t", config="x", sources=SOURCES, token_budget=1, objective="math").validate()


def test_fit_recovers_a_log_law_and_recommends_its_optimum() -> None:
    rng = np.random.default_rng(0)
    W = rng.dirichlet([2, 2, 2], size=8)
    a, b = np.array([3.0, 4.0, 2.5]), np.array([-0.2, -0.4, -0.1])
    L = a + b * np.log(W + LOG_EPS)
    f, rec = recommend(W, L, SOURCES, "mean", "log_linear")
    for d in range(3):
        np.testing.assert_allclose(f.coefs[d], [a[d], b[d]], atol=1e-9)
    np.testing.assert_allclose(f.loo_rmse, 0.0, atol=1e-9)  # an exact law predicts held-out mixtures exactly
    assert rec.objective_loo_rmse < 1e-9 < rec.objective_baseline_rmse
    # Inside the box of tried weights, the fitted optimum beats every tried mixture and every candidate.
    assert rec.predicted_objective <= (L.mean(axis=1)).min() + 1e-12
    lo, hi = W.min(axis=0), W.max(axis=0)
    assert ((rec.weights >= lo - 1e-9) & (rec.weights <= hi + 1e-9)).all()
    # Unconstrained optimum of mean_d(b_d log(w_d + eps)) is w_d + eps ∝ b_d; within the box the prose weight
    # (largest |b|) is the largest.
    assert int(np.argmax(rec.weights)) == 1


def test_noisy_fit_reports_a_real_loo_error() -> None:
    rng = np.random.default_rng(1)
    W = rng.dirichlet([1, 1, 1], size=6)
    L = 3 - 0.3 * np.log(W + LOG_EPS) + rng.normal(0, 0.05, size=W.shape)
    f = fit(W, L, "linear")
    assert (f.loo_rmse > 0.01).all() and np.isfinite(f.baseline_rmse).all()
    few = fit(W[:3], L[:3], "linear")  # 3 mixtures, 3 parameters: no leave-one-out possible
    assert np.isnan(few.loo_rmse).all()


def test_pareto_mask() -> None:
    L = np.array([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0], [2.5, 2.5], [1.0, 3.0]])
    assert pareto_mask(L).tolist() == [True, True, True, False, True]
