"""Surrogates of the ablation objective: what the proposal minimizes, each with an uncertainty band.

Three models of the objective (mean per-domain validation loss, or one domain's) as a function of the weights:

    log_linear, linear   today's per-domain least-squares fits (ablate_fit.py) summed into the objective; their band
                         is the leave-one-out RMSE of the objective (one number for every mixture)
    gp                   a trend c + Σ_j β_j·log(w_j + 0.01) plus a Gaussian process on its residuals (scikit-learn,
                         anisotropic RBF + white noise, hyperparameters by marginal likelihood): captures
                         interactions between sources that neither parametric model has, and its posterior standard
                         deviation (plus the fitted noise) grows away from the tried mixtures; it is scaled up
                         when the leave-one-out z-scores say it is overconfident

Every surrogate carries its leave-one-mixture-out RMSE (refit without mixture i, hyperparameters included, predict
it) next to the constant predictor's (the mean of the other mixtures); `best` picks the lowest LOO error, so a GP
that overfits a small swarm loses to a two-parameter law. scikit-learn is the `ablate` extra (pyproject): only the
report imports this module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from framework.base.errors import ConfigError
from framework.drivers.ablate_fit import LOG_EPS, Model, fit, objective_values

Predict = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Surrogate:
    """The objective as a function of the weights: `predict(W) -> (mean, std)` for rows of W."""

    name: str
    predict: Predict
    loo_pred: np.ndarray
    """(n,) each tried mixture's objective predicted by a fit that never saw it."""
    loo_rmse: float
    baseline_rmse: float
    """Leave-one-out RMSE of the constant predictor (mean of the other mixtures)."""


def _baseline_rmse(y: np.ndarray) -> float:
    n = len(y)
    if n < 2:
        return float("nan")
    base = (y.sum() - y) / (n - 1)
    return float(np.sqrt(np.mean((base - y) ** 2)))


def parametric(W: np.ndarray, L: np.ndarray, sources: list[str], objective: str, model: Model,
               earlier: tuple[np.ndarray, np.ndarray] | None = None) -> Surrogate:
    """Today's per-domain fit as an objective surrogate; its band is the objective's leave-one-out RMSE.

    `earlier`: rows (weights, losses with NaN holes) of earlier swarms (ablate_reuse.py); they join the per-domain
    fits, and every leave-one-out error is still measured on this swarm's mixtures (each refit keeps them).
    """
    n = len(W)
    if earlier is not None and len(earlier[0]):
        f = fit(np.vstack([W, earlier[0]]), np.vstack([L, earlier[1]]), model)
    else:
        f = fit(W, L, model)
    y = objective_values(L, sources, objective)
    loo = objective_values(f.loo_pred[:n], sources, objective)
    rmse = float(np.sqrt(np.mean((loo - y) ** 2)))

    def predict(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return objective_values(f.predict(X), sources, objective), np.full(len(X), rmse)

    return Surrogate(model, predict, loo, rmse, _baseline_rmse(y))


def _trend(W: np.ndarray) -> np.ndarray:
    """The GP's mean: c + Σ_j β_j·log(w_j + 0.01), the diminishing-returns shape of loss in a source's weight."""
    return np.hstack([np.ones((len(W), 1)), np.log(W + LOG_EPS)])


def _fit_gp(W: np.ndarray, y: np.ndarray, seed: int) -> Predict:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    coef, *_ = np.linalg.lstsq(_trend(W), y, rcond=None)
    resid = y - _trend(W) @ coef
    scale = float(resid.std()) or 1e-6
    k = W.shape[1]
    kernel = ConstantKernel(1.0, (1e-3, 1e2)) * RBF(np.full(k, 0.3), (1e-2, 1e1)) + WhiteKernel(1e-2, (1e-6, 1.0))
    gp = GaussianProcessRegressor(kernel, normalize_y=False, n_restarts_optimizer=0, random_state=seed)
    with warnings.catch_warnings():  # a length scale at its bound is a fine answer (the trend explains it all)
        warnings.simplefilter("ignore", ConvergenceWarning)
        gp.fit(W, resid / scale)

    def predict(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mean, std = gp.predict(X, return_std=True)
        return _trend(X) @ coef + scale * mean, scale * std

    return predict


def gaussian_process(W: np.ndarray, y: np.ndarray, seed: int = 0) -> Surrogate:
    """Log-weight trend + GP residual fitted to the objective values `y` of the tried mixtures `W`."""
    n, k = W.shape
    if n <= k + 2:
        raise ConfigError(f"the Gaussian-process surrogate needs more than {k + 2} mixtures (it fits a trend "
                          f"with {k + 1} coefficients plus a noise level); the ablation has {n} — add Dirichlet "
                          f"samples")
    predict = _fit_gp(W, y, seed)
    held = [_fit_gp(np.delete(W, i, 0), np.delete(y, i), seed)(W[i:i + 1]) for i in range(n)]
    loo = np.array([m[0] for m, _ in held])
    # Calibration: the posterior std scaled so held-out z-scores have unit RMS (never shrunk below the GP's own).
    z = (loo - y) / np.maximum(np.array([s[0] for _, s in held]), 1e-12)
    calib = max(1.0, float(np.sqrt(np.mean(z ** 2))))

    def calibrated(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mean, std = predict(X)
        return mean, calib * std

    return Surrogate("gp", calibrated, loo, float(np.sqrt(np.mean((loo - y) ** 2))), _baseline_rmse(y))


def all_surrogates(W: np.ndarray, L: np.ndarray, sources: list[str], objective: str,
                   earlier: tuple[np.ndarray, np.ndarray] | None = None) -> list[Surrogate]:
    """Every surrogate that the number of mixtures allows (LOO needs more mixtures than parameters); `earlier`
    swarms' rows join the per-domain fits only (the GP models the objective, which they may not cover)."""
    n, k = W.shape
    out = [parametric(W, L, sources, objective, "log_linear", earlier)]
    if n > k:
        out.append(parametric(W, L, sources, objective, "linear", earlier))
    if n > k + 2:
        out.append(gaussian_process(W, objective_values(L, sources, objective)))
    return out


def best(surrogates: list[Surrogate], name: str = "auto") -> Surrogate:
    """The named surrogate, or ('auto') the one with the lowest leave-one-out RMSE."""
    if name != "auto":
        named = [s for s in surrogates if s.name == name]
        if not named:
            raise ConfigError(f"proposal.surrogate={name!r} is not available for this ablation (have "
                              f"{[s.name for s in surrogates]}); the GP needs more than k + 2 mixtures")
        return named[0]
    finite = [s for s in surrogates if np.isfinite(s.loo_rmse)] or surrogates
    return min(finite, key=lambda s: s.loo_rmse)
