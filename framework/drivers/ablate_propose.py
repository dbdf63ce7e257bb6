"""The proposal: the mixture that minimizes a surrogate over the whole simplex under the user's limits.

Limits (all optional, `proposal:` in the ablation spec):

    min_weight / max_weight   per-source box
    max_epochs                per-source repetition limit at the target token budget T: a source of N_s training
                              tokens is read w_s·T/N_s times, so w_s <= max_epochs_s·N_s/T (N_s from the runs'
                              data build, `train_tokens` in result.json)
    kl_max                    KL(w || prior) <= kl_max: stay near a trusted mixture
    trust_region              (on by default) w is a convex combination of the tried mixtures: the proposal stays
                              inside the swarm, where the surrogates' leave-one-out errors were measured

The minimization is SLSQP (scipy) from the best feasible points of a dense random cover of the simplex, so it is
not confined to the box of tried weights (only to the swarm's hull, with the trust region). Without the trust
region a surrogate that extrapolates is believed everywhere: a linear fit's minimum is always a vertex, and on the
stdlib swarm that vertex (code only) measured worse than the best tried mixture although the linear fit had the
lowest leave-one-out error at the swarm. A KL ball around the prior as large as the swarm's reach was tried first
and is not enough: the swarm reaches far in one direction only, and a linear fit then runs to the ball's edge in
another (regret 0.03-0.04 nats on the planted law, tests/drivers/test_ablate_propose.py).

After the minimization, each active limit is dropped in turn and the problem solved again: a limit *binds* when
dropping it lowers the predicted objective (the report says by how much), so a limit that merely touches the
answer is told apart from one that moves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from framework.base.errors import ConfigError

Objective = Callable[[np.ndarray], np.ndarray]
"""Rows of weights -> the value to minimize per row."""
TOL = 1e-6


@dataclass(kw_only=True, frozen=True)
class ProposalSpec:
    """The user's limits on the proposed mixture (spec key `proposal`)."""

    target_tokens: int = 0
    """Token budget of the run the mixture is for (0: the proxies' token_budget); sets the epochs a weight means."""
    max_epochs: dict[str, float] = field(default_factory=dict)
    """Per-source maximum epochs at target_tokens."""
    min_weight: dict[str, float] = field(default_factory=dict)
    max_weight: dict[str, float] = field(default_factory=dict)
    prior: dict[str, float] = field(default_factory=dict)
    """Reference mixture of the KL bound (empty: mixtures.prior, else uniform)."""
    kl_max: float = 0.0
    """KL(w || prior) bound in nats; 0: none."""
    surrogate: str = "auto"
    """Which fit to minimize: auto (lowest leave-one-out error), gp, log_linear or linear."""
    risk: float = 0.0
    """Minimize mean + risk x std of the surrogate (0: the mean; 1: a pessimistic proposal)."""
    trust_region: bool = True
    """Propose only convex combinations of the tried mixtures (the swarm's hull); false: the whole simplex."""

    def validate(self) -> None:
        if self.target_tokens < 0 or self.kl_max < 0 or self.risk < 0:
            raise ConfigError(f"proposal: target_tokens={self.target_tokens}, kl_max={self.kl_max} and risk="
                              f"{self.risk} must be >= 0")
        if any(e <= 0 for e in self.max_epochs.values()):
            raise ConfigError(f"proposal.max_epochs={self.max_epochs} must be positive; e.g. {{tests: 4}}")
        if self.surrogate not in ("auto", "gp", "log_linear", "linear"):
            raise ConfigError(f"proposal.surrogate={self.surrogate!r} must be auto, gp, log_linear or linear")


@dataclass(frozen=True)
class Limits:
    """The limits as arrays over the sources (in the spec's order)."""

    lo: np.ndarray
    hi: np.ndarray
    """The max_weight box alone."""
    epoch_hi: np.ndarray
    """max_epochs_s · N_s / T (inf without a limit)."""
    prior: np.ndarray
    kl_max: float
    """0: no KL bound."""
    hull: np.ndarray | None = None
    """The trust region: rows of tried mixtures the proposal is a convex combination of; None: the whole simplex."""

    def upper(self) -> np.ndarray:
        return np.minimum(self.hi, self.epoch_hi)


def limits(spec: ProposalSpec, sources: list[str], token_budget: int, train_tokens: dict[str, int],
           swarm_prior: dict[str, float], tried: np.ndarray | None = None) -> Limits:
    """Arrays of the limits; `train_tokens` by source from the build (needed only with max_epochs); `tried`: the
    swarm's mixtures (rows), the trust region's corners."""
    target = spec.target_tokens or token_budget
    missing = [s for s in spec.max_epochs if s not in train_tokens]
    if missing:
        raise ConfigError(f"proposal.max_epochs names {missing}, whose training token counts the runs did not "
                          f"record (train_tokens in result.json has {sorted(train_tokens)}); rerun the ablation")
    epoch_hi = np.array([spec.max_epochs[s] * train_tokens[s] / target if s in spec.max_epochs else np.inf
                         for s in sources])
    named = spec.prior or swarm_prior or dict.fromkeys(sources, 1.0)
    prior = np.array([named.get(s, 0.0) for s in sources], dtype=np.float64)
    return Limits(lo=np.array([spec.min_weight.get(s, 0.0) for s in sources]),
                  hi=np.array([spec.max_weight.get(s, 1.0) for s in sources]),
                  epoch_hi=epoch_hi, prior=prior / prior.sum(), kl_max=spec.kl_max,
                  hull=np.asarray(tried, dtype=np.float64) if spec.trust_region and tried is not None and len(tried)
                  else None)


def kl(W: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """KL(w || prior) per row (inf where w puts weight on a source the prior excludes)."""
    W = np.atleast_2d(W)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(W > 0, W * np.log(W / prior), 0.0)
    return np.asarray(terms.sum(axis=1))


def feasible(W: np.ndarray, lim: Limits, tol: float = TOL) -> np.ndarray:
    W = np.atleast_2d(W)
    ok = ((W >= lim.lo - tol) & (W <= lim.upper() + tol)).all(axis=1) & (np.abs(W.sum(axis=1) - 1) < tol)
    if lim.kl_max:
        ok &= kl(W, lim.prior) <= lim.kl_max + tol
    return np.asarray(ok)


def _starts(f: Objective, lim: Limits, seed: int, n_starts: int = 6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    k = len(lim.lo)
    cover = np.vstack([rng.dirichlet(np.ones(k), 20_000), rng.dirichlet(np.full(k, 0.3), 5_000),
                       rng.dirichlet(20 * lim.prior + 1e-3, 5_000), lim.prior[None]])
    cover = cover[feasible(cover, lim)]
    if not len(cover):  # a thin feasible set: start from the box's projection of the prior
        x = np.clip(lim.prior, lim.lo, lim.upper())
        return np.asarray(x / x.sum())[None]
    return cover[np.argsort(f(cover))[:n_starts]]


def _minimize_in_hull(f: Objective, lim: Limits, hull: np.ndarray, n_starts: int = 6) -> np.ndarray:
    """The feasible convex combination w = lam @ hull with the lowest f: SLSQP over lam from the best tried
    mixtures and their centroid. Every limit is a constraint on w."""
    from scipy.optimize import minimize as scipy_minimize

    upper = np.minimum(lim.upper(), 1.0)
    cons: list[dict[str, object]] = [{"type": "eq", "fun": lambda lam: lam.sum() - 1},
                                     {"type": "ineq", "fun": lambda lam: lam @ hull - lim.lo},
                                     {"type": "ineq", "fun": lambda lam: upper - lam @ hull}]
    if lim.kl_max:
        cons.append({"type": "ineq", "fun": lambda lam: lim.kl_max - kl(np.clip(lam @ hull, 1e-12, None),
                                                                        lim.prior)[0]})
    n = len(hull)
    order = np.argsort(f(hull) + np.where(feasible(hull, lim), 0.0, np.inf))  # the hull is not checked there
    starts = [np.eye(n)[i] for i in order[:n_starts]] + [np.full(n, 1.0 / n)]
    best, best_f = None, np.inf
    for x0 in starts:
        r = scipy_minimize(lambda lam: float(f((lam @ hull)[None])[0]), x0, method="SLSQP",
                           bounds=[(0.0, 1.0)] * n, constraints=cons, options={"maxiter": 300, "ftol": 1e-12})
        for lam in (np.clip(np.asarray(r.x), 0.0, None), x0):
            w = lam / lam.sum() @ hull
            val = float(f(w[None])[0])
            if feasible(w, lim) and val < best_f:
                best, best_f = w, val
    if best is None:
        raise ConfigError("proposal: no convex combination of the tried mixtures satisfies the limits; loosen them, "
                          "or set proposal.trust_region=false to search the whole simplex")
    return np.asarray(best)


def minimize(f: Objective, lim: Limits, seed: int = 0) -> np.ndarray:
    """The feasible mixture with the lowest f: SLSQP from the best points of a random cover of the simplex (of the
    swarm's hull with the trust region)."""
    from scipy.optimize import minimize as scipy_minimize

    upper = lim.upper()
    if lim.lo.sum() > 1 + TOL or upper.sum() < 1 - TOL:
        raise ConfigError(f"proposal: no mixture fits the limits: minimum weights sum to {lim.lo.sum():.3f} and "
                          f"maximum weights (max_weight and max_epochs at the target budget) to {upper.sum():.3f}; "
                          f"the minimums must sum to <= 1 <= the maximums — raise max_epochs or max_weight")
    if lim.hull is not None:
        return _minimize_in_hull(f, lim, lim.hull)
    cons: list[dict[str, object]] = [{"type": "eq", "fun": lambda w: w.sum() - 1}]
    if lim.kl_max:
        cons.append({"type": "ineq", "fun": lambda w: lim.kl_max - kl(np.clip(w, 1e-12, None), lim.prior)[0]})
    bounds = list(zip(lim.lo, np.minimum(upper, 1.0), strict=True))
    best, best_f = None, np.inf
    for x0 in _starts(f, lim, seed):
        r = scipy_minimize(lambda w: float(f(w[None])[0]), x0, method="SLSQP", bounds=bounds, constraints=cons,
                           options={"maxiter": 300, "ftol": 1e-12})
        for w in (np.asarray(r.x), x0):
            val = float(f(w[None])[0])
            if feasible(w, lim) and val < best_f:
                best, best_f = w, val
    if best is None:
        raise ConfigError(f"proposal: no mixture satisfies the limits (KL bound {lim.kl_max} to the prior "
                          f"{np.round(lim.prior, 3).tolist()} inside the weight box); loosen kl_max or the box")
    return np.asarray(best)


@dataclass(frozen=True)
class Binding:
    limit: str
    """e.g. 'max_epochs[tests]', 'min_weight[code]', 'kl_max', 'trust_region'."""
    gain: float
    """How much lower the predicted objective is with this limit dropped (> 0: it binds)."""


def _active(w: np.ndarray, lim: Limits, sources: list[str]) -> list[tuple[str, Limits]]:
    """Limits the solution touches, each with the Limits that drop it."""
    out: list[tuple[str, Limits]] = []
    for i, s in enumerate(sources):
        if lim.lo[i] > 0 and w[i] <= lim.lo[i] + 1e-4:
            out.append((f"min_weight[{s}]", replace(lim, lo=np.where(np.arange(len(w)) == i, 0.0, lim.lo))))
        if np.isfinite(lim.epoch_hi[i]) and w[i] >= lim.epoch_hi[i] - 1e-4 and lim.epoch_hi[i] <= lim.hi[i]:
            out.append((f"max_epochs[{s}]", replace(lim, epoch_hi=np.where(np.arange(len(w)) == i, np.inf,
                                                                           lim.epoch_hi))))
        elif lim.hi[i] < 1 and w[i] >= lim.hi[i] - 1e-4:
            out.append((f"max_weight[{s}]", replace(lim, hi=np.where(np.arange(len(w)) == i, 1.0, lim.hi))))
    if lim.kl_max and kl(w, lim.prior)[0] >= lim.kl_max - 1e-4:
        out.append(("kl_max", replace(lim, kl_max=0.0)))
    if lim.hull is not None:  # touching the hull is not cheap to test; the gain of dropping it says if it binds
        out.append(("trust_region", replace(lim, hull=None)))
    return out


@dataclass(frozen=True)
class Proposal:
    weights: np.ndarray
    mean: float
    std: float
    epochs: np.ndarray
    """Epochs of each source the proposal reads at the target budget (nan where the token count is unknown)."""
    binding: list[Binding]
    """Active limits with the gain from dropping each; those with gain > tolerance bind."""
    unconstrained: np.ndarray
    """The minimizer over the bare simplex, for comparison."""
    unconstrained_mean: float


def propose(predict: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], lim: Limits, sources: list[str],
            target_tokens: int, train_tokens: dict[str, int], risk: float = 0.0, seed: int = 0) -> Proposal:
    """Minimize mean + risk·std of `predict` under `lim`; name the limits that bind."""
    def f(W: np.ndarray) -> np.ndarray:
        mean, std = predict(W)
        return mean + risk * std if risk else mean

    w = minimize(f, lim, seed)
    here = float(f(w[None])[0])
    binding = [Binding(name, here - float(f(minimize(f, dropped, seed)[None])[0]))
               for name, dropped in _active(w, lim, sources)]
    binding = [b for b in binding if b.limit != "trust_region" or b.gain > TOL]
    k = len(sources)
    free = Limits(np.zeros(k), np.ones(k), np.full(k, np.inf), lim.prior, 0.0)
    u = minimize(f, free, seed)
    mean, std = predict(w[None])
    epochs = np.array([w[i] * target_tokens / train_tokens[s] if train_tokens.get(s) else np.nan
                       for i, s in enumerate(sources)])
    return Proposal(w, float(mean[0]), float(std[0]), epochs, binding, u, float(predict(u[None])[0][0]))
