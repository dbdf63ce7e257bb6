"""Fitting per-domain validation loss against mixture weights, and the mixture it recommends.

Two per-domain models, both linear least squares in their features:

    log_linear  L_d(w) = a_d + b_d · log(w_d + 0.01)       own-weight law: 2 parameters per domain, so it can be
                                                             fitted (and cross-validated) from a handful of runs
    linear      L_d(w) = a_d + Σ_{j<k} b_dj · w_j            the RegMix-style linear model on the simplex (the last
                                                             weight is implied); needs more runs than sources

Honesty: every fit is reported with its leave-one-mixture-out error (refit without mixture i, predict it) next to
that of the constant predictor (the mean of the other mixtures), so a regression that does not beat the mean is
visible. The recommendation minimizes the fitted objective only inside the box of weights that were tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Model = Literal["log_linear", "linear"]
LOG_EPS = 0.01
"""Keeps log(w) finite at w = 0; a domain at 0 weight is still 'seen' through overlap with the others."""


def features(W: np.ndarray, d: int, model: Model) -> np.ndarray:
    """Design matrix for domain `d` (rows: mixtures, W: (n, k) weights)."""
    ones = np.ones((W.shape[0], 1))
    if model == "log_linear":
        return np.hstack([ones, np.log(W[:, d:d + 1] + LOG_EPS)])
    return np.hstack([ones, W[:, :-1]])


def objective_values(L: np.ndarray, sources: list[str], objective: str) -> np.ndarray:
    """Objective per row of per-domain losses L (n, k): their mean, or one source's loss."""
    return L.mean(axis=1) if objective == "mean" else L[:, sources.index(objective)]


def _lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    return np.asarray(coef)


@dataclass(frozen=True)
class Fit:
    """Per-domain least-squares fits with leave-one-out errors."""

    model: Model
    coefs: list[np.ndarray]
    loo_pred: np.ndarray
    """(n, k): each mixture's losses predicted by fits that never saw it (nan when too few mixtures)."""
    loo_rmse: np.ndarray
    """(k,) per-domain leave-one-out RMSE of the regression."""
    baseline_rmse: np.ndarray
    """(k,) leave-one-out RMSE of the constant predictor (mean of the other mixtures)."""

    def predict(self, W: np.ndarray) -> np.ndarray:
        return np.stack([features(W, d, self.model) @ c for d, c in enumerate(self.coefs)], axis=1)

    def n_params(self, k: int) -> int:
        return 2 if self.model == "log_linear" else k


def fit(W: np.ndarray, L: np.ndarray, model: Model) -> Fit:
    """Fit every domain's loss L[:, d] on the weights W (both (n, k)); leave-one-out when a domain has more rows
    than parameters.

    Rows of earlier swarms (ablate_reuse.py) may lack a domain (NaN loss: that run did not evaluate it) or lie off
    the simplex (their remaining weight went to a source no longer mixed). A domain's fit leaves out its NaN rows;
    the linear model also leaves out rows off the simplex, where its implied last weight would be wrong, while the
    own-weight law needs only w_d and takes them.
    """
    n, k = W.shape
    usable = np.isfinite(L) & ((np.abs(W.sum(axis=1) - 1) < 1e-6) | (model != "linear"))[:, None]
    coefs = [_lstsq(features(W[usable[:, d]], d, model), L[usable[:, d], d]) for d in range(k)]
    p = 2 if model == "log_linear" else k
    loo = np.full((n, k), np.nan)
    base = np.full((n, k), np.nan)
    for d in range(k):
        rows = np.flatnonzero(usable[:, d])
        for i in rows if len(rows) > p else ():
            keep = usable[:, d] & (np.arange(n) != i)
            c = _lstsq(features(W[keep], d, model), L[keep, d])
            loo[i, d] = (features(W[i:i + 1], d, model) @ c)[0]
            base[i, d] = L[keep, d].mean()
    return Fit(model, coefs, loo, _rms(loo - L), _rms(base - L))


def _rms(err: np.ndarray) -> np.ndarray:
    """Per-column root mean square over the finite entries (NaN for a column with none)."""
    ok = np.isfinite(err)
    sq = np.where(ok, err, 0.0) ** 2
    with np.errstate(invalid="ignore"):
        return np.asarray(np.sqrt(sq.sum(axis=0) / ok.sum(axis=0)))


def candidate_mixtures(W: np.ndarray, seed: int = 0) -> np.ndarray:
    """Mixtures to search: a fine simplex lattice (k <= 4) or Dirichlet samples, inside the tried weight box."""
    from framework.drivers.ablate import simplex_grid

    k = W.shape[1]
    if k == 1:
        return W[:1]
    if k <= 4:
        cand = simplex_grid(k, {2: 0.005, 3: 0.01, 4: 0.025}[k])
    else:
        cand = np.random.default_rng(seed).dirichlet(np.ones(k), size=50_000)
    lo, hi = W.min(axis=0) - 1e-9, W.max(axis=0) + 1e-9
    inside = ((cand >= lo) & (cand <= hi)).all(axis=1)
    cand = cand[inside]
    return np.vstack([cand, W])  # the tried mixtures are always candidates


@dataclass(frozen=True)
class Recommendation:
    weights: np.ndarray
    predicted: np.ndarray
    """(k,) predicted per-domain losses."""
    predicted_objective: float
    objective_loo_rmse: float
    """Leave-one-out RMSE of the fitted objective over the tried mixtures."""
    objective_baseline_rmse: float
    best_tried: int
    """Index of the tried mixture with the lowest measured objective (for comparison)."""


def recommend(W: np.ndarray, L: np.ndarray, sources: list[str], objective: str, model: Model) -> tuple[
        Fit, Recommendation]:
    """Fit, then minimize the fitted objective over candidate mixtures inside the tried box."""
    f = fit(W, L, model)
    cand = candidate_mixtures(W)
    pred = f.predict(cand)
    obj = objective_values(pred, sources, objective)
    best = int(np.argmin(obj))
    measured = objective_values(L, sources, objective)
    loo_obj = objective_values(f.loo_pred, sources, objective)
    n = len(W)
    base_obj = np.array([np.delete(measured, i).mean() for i in range(n)]) if n > 1 else np.full(n, np.nan)
    return f, Recommendation(
        weights=cand[best], predicted=pred[best], predicted_objective=float(obj[best]),
        objective_loo_rmse=float(np.sqrt(np.mean((loo_obj - measured) ** 2))),
        objective_baseline_rmse=float(np.sqrt(np.mean((base_obj - measured) ** 2))),
        best_tried=int(np.argmin(measured)))


def pareto_mask(L: np.ndarray) -> np.ndarray:
    """True for rows not dominated by another (<= in every domain and < in one)."""
    n = len(L)
    keep = np.ones(n, dtype=bool)
    for i in range(n):
        others = np.delete(L, i, axis=0)
        keep[i] = not ((others <= L[i]).all(axis=1) & (others < L[i]).any(axis=1)).any()
    return keep
