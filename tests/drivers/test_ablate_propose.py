"""Swarm design, surrogates and the constrained proposal against planted optima: a known loss-vs-weight law with an
interaction between two sources, its optimum found independently by brute force on a fine simplex lattice (and in
closed form for the pure log law), and a small source whose repetition limit moves the answer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from framework.base.errors import ConfigError
from framework.drivers.ablate import AblationSpec, MixtureSpec, RunPlan, confirm_runs, plan_runs, simplex_grid, swarm
from framework.drivers.ablate_fit import LOG_EPS
from framework.drivers.ablate_propose import ProposalSpec, kl, limits, propose
from framework.drivers.ablate_report import write_report
from framework.drivers.ablate_surrogate import all_surrogates, best, parametric

SOURCES = ["code", "prose", "tests"]
A, B = np.array([3.0, 4.0, 2.5]), np.array([-0.2, -0.4, -0.25])
TARGET = 10**6
TOKENS = {"code": 10**7, "prose": 10**7, "tests": 10**5}  # tests: one epoch is 10% of the target budget
WEIGHT_TOL = 0.06
"""The fitted proposal lands within this (max over sources) of the true optimum: the valley is flat, so 24 noisy
proxies place it to a few hundredths (0.006-0.053 over 4 swarm seeds, 0.002-0.017 with the epoch limit)."""
REGRET_TOL = 3e-3
"""...and its true objective is within this many nats of the true optimum's (the noise per proxy is 5e-3)."""


def _law(W: np.ndarray, interaction: float) -> np.ndarray:
    """Per-domain loss: own-weight log law, plus code and tests interfering (a term no per-domain fit has)."""
    return A + B * np.log(W + LOG_EPS) + interaction * W[:, :1] * W[:, 2:]


def _brute(interaction: float, tests_cap: float = 1.0) -> np.ndarray:
    grid = simplex_grid(3, 0.0025)
    grid = grid[grid[:, 2] <= tests_cap + 1e-12]
    return np.asarray(grid[np.argmin(_law(grid, interaction).mean(axis=1))])


def _spec(**mix: object) -> AblationSpec:
    return AblationSpec(name="t", config="x.yaml", sources=SOURCES, token_budget=100,
                        mixtures=MixtureSpec(**mix))  # type: ignore[arg-type]


def test_swarm_is_dirichlet_around_the_prior_inside_the_box() -> None:
    spec = _spec(dirichlet=400, prior={"code": 0.5, "prose": 0.3, "tests": 0.2}, concentration=50,
                 min_weight={"tests": 0.1}, max_weight={"code": 0.6})
    W = swarm(spec)
    assert W.shape == (400, 3) and np.allclose(W.sum(axis=1), 1)
    assert W[:, 2].min() >= 0.1 and W[:, 0].max() <= 0.6
    np.testing.assert_allclose(W.mean(axis=0), [0.5, 0.3, 0.2], atol=0.02)  # centred on the prior
    assert np.array_equal(W, swarm(spec))  # reproducible from mixtures.seed
    wide = swarm(_spec(dirichlet=400, prior={"code": 0.5, "prose": 0.3, "tests": 0.2}, concentration=3))
    assert wide.std(axis=0).min() > 1.5 * W.std(axis=0).max()  # concentration sets the spread
    with pytest.raises(ConfigError, match="fell inside"):
        swarm(_spec(dirichlet=4, prior={"code": 0.9, "prose": 0.05, "tests": 0.05}, concentration=2000,
                    min_weight={"tests": 0.5}))


def test_minimizer_finds_the_closed_form_optimum_and_the_capped_one() -> None:
    # mean_d(b_d·log(w_d + eps)) is minimized at w_d + eps ∝ |b_d|; with w_tests capped at c, the others split 1 - c
    # the same way.
    def truth(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _law(W, 0.0).mean(axis=1), np.zeros(len(W))

    free = np.abs(B) * (1 + 3 * LOG_EPS) / np.abs(B).sum() - LOG_EPS
    p = propose(truth, limits(ProposalSpec(), SOURCES, TARGET, TOKENS, {}), SOURCES, TARGET, TOKENS)
    np.testing.assert_allclose(p.weights, free, atol=2e-4)
    assert p.binding == []
    capped = limits(ProposalSpec(max_epochs={"tests": 1.0}), SOURCES, TARGET, TOKENS, {})
    p = propose(truth, capped, SOURCES, TARGET, TOKENS)
    rest = np.abs(B[:2]) * (0.9 + 2 * LOG_EPS) / np.abs(B[:2]).sum() - LOG_EPS
    np.testing.assert_allclose(p.weights, [*rest, 0.1], atol=2e-4)
    assert p.epochs[2] == pytest.approx(1.0, abs=1e-3)
    assert [b.limit for b in p.binding] == ["max_epochs[tests]"] and p.binding[0].gain > 1e-3
    np.testing.assert_allclose(p.unconstrained, free, atol=2e-4)
    # A KL bound to the uniform prior pulls the answer toward it and binds; a loose one does not.
    tight = limits(ProposalSpec(kl_max=0.02), SOURCES, TARGET, TOKENS, {})
    p = propose(truth, tight, SOURCES, TARGET, TOKENS)
    assert kl(p.weights, tight.prior)[0] == pytest.approx(0.02, abs=1e-4)
    assert [b.limit for b in p.binding] == ["kl_max"]
    assert propose(truth, limits(ProposalSpec(kl_max=5.0), SOURCES, TARGET, TOKENS, {}), SOURCES, TARGET,
                   TOKENS).binding == []
    with pytest.raises(ConfigError, match="no mixture fits"):
        limits_all = limits(ProposalSpec(max_epochs=dict.fromkeys(SOURCES, 0.01)), SOURCES, TARGET, TOKENS, {})
        propose(truth, limits_all, SOURCES, TARGET, TOKENS)


def test_fit_and_proposal_recover_a_planted_optimum_with_interactions() -> None:
    rng = np.random.default_rng(0)
    W = swarm(_spec(dirichlet=24, prior=dict.fromkeys(SOURCES, 1.0), concentration=3))
    L = _law(W, 0.5) + rng.normal(0, 0.005, W.shape)  # seed noise
    surrogates = {s.name: s for s in all_surrogates(W, L, SOURCES, "mean")}
    gp = surrogates["gp"]
    # Honest errors: every fit beats the constant predictor; only the GP sees the interaction, so it is best.
    assert all(s.loo_rmse < s.baseline_rmse for s in surrogates.values())
    assert gp.loo_rmse < 0.6 * surrogates["log_linear"].loo_rmse and best(list(surrogates.values())) is gp
    # Its band covers the truth at held-out mixtures about as often as a 2-sigma band should.
    Wt = swarm(_spec(dirichlet=200, prior=dict.fromkeys(SOURCES, 1.0), concentration=3, seed=1))
    mean, std = gp.predict(Wt)
    assert np.mean(np.abs(mean - _law(Wt, 0.5).mean(axis=1)) <= 2 * std) > 0.8

    free = propose(gp.predict, limits(ProposalSpec(), SOURCES, TARGET, TOKENS, {}, tried=W), SOURCES, TARGET, TOKENS)
    truth_free = _brute(0.5)
    assert np.abs(free.weights - truth_free).max() < WEIGHT_TOL and free.weights[2] > 0.2
    assert free.binding == []  # the optimum lies inside the swarm: the trust region does not bind
    assert _law(free.weights[None], 0.5).mean() - _law(truth_free[None], 0.5).mean() < REGRET_TOL
    # Repetition: one epoch of tests is 10% of the target budget; its optimum (~25%) would read it 2.5 times.
    spec = ProposalSpec(max_epochs={"tests": 1.0}, target_tokens=TARGET)
    capped = propose(gp.predict, limits(spec, SOURCES, 123, TOKENS, {}), SOURCES, TARGET, TOKENS)
    truth_capped = _brute(0.5, tests_cap=0.1)
    assert np.abs(capped.weights - truth_capped).max() < WEIGHT_TOL
    assert capped.weights[2] == pytest.approx(0.1, abs=1e-4) and capped.epochs[2] <= 1.0 + 1e-4
    assert np.abs(capped.weights - free.weights).max() > 0.1  # the limit changed the answer
    assert [b.limit for b in capped.binding] == ["max_epochs[tests]"] and capped.binding[0].gain > 0
    true_regret = _law(capped.weights[None], 0.5).mean() - _law(truth_capped[None], 0.5).mean()
    assert true_regret < REGRET_TOL


def test_trust_region_keeps_a_linear_fit_inside_the_swarm() -> None:
    """A linear surrogate's minimum over the simplex is a vertex, where the planted log law is bad (a source at 0);
    with the trust region (the default) the proposal is a convex combination of tried mixtures."""
    prior = {"code": 0.34, "prose": 0.33, "tests": 0.33}
    W = swarm(_spec(dirichlet=12, prior=prior, concentration=4, min_weight=dict.fromkeys(SOURCES, 0.05)))
    L = _law(W, 0.5) + np.random.default_rng(0).normal(0, 0.005, W.shape)
    lin = parametric(W, L, SOURCES, "mean", "linear")

    def truth(w: np.ndarray) -> float:
        return float(_law(w[None], 0.5).mean())

    free = propose(lin.predict, limits(ProposalSpec(trust_region=False), SOURCES, TARGET, TOKENS, prior, tried=W),
                   SOURCES, TARGET, TOKENS)
    held = propose(lin.predict, limits(ProposalSpec(), SOURCES, TARGET, TOKENS, prior, tried=W), SOURCES, TARGET,
                   TOKENS)
    assert free.weights.max() > 0.99 and free.binding == []
    assert truth(free.weights) > min(truth(w) for w in W) + 0.2  # the untried vertex is bad in truth
    # Inside the hull, checked independently: a linear program finds convex coefficients for it.
    from scipy.optimize import linprog

    lp = linprog(np.zeros(len(W)), A_eq=np.vstack([W.T, np.ones(len(W))]), b_eq=np.append(held.weights, 1.0),
                 bounds=(0, None))
    assert lp.status == 0, lp.message
    # A linear function on a polytope is least at a corner: the tried mixture the fit ranks best.
    assert np.abs(held.weights - W[np.argmin(lin.predict(W)[0])]).max() < 1e-6
    assert truth(held.weights) < truth(free.weights) - 0.2
    assert [b.limit for b in held.binding] == ["trust_region"] and held.binding[0].gain > 0


def _fake_run(plan: RunPlan, losses: np.ndarray) -> None:
    """A finished run as `run_one` leaves it: result.json and a short metrics.jsonl (no training)."""
    plan.path.mkdir(parents=True, exist_ok=True)
    val = {f"val_loss/{s}": float(x) for s, x in zip(SOURCES, losses)}
    rows = [{"type": "train", "step": i, "loss": 6.0 - i, "tokens": 512 * i} for i in range(1, 5)]
    plan.path.joinpath("metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        *rows, {"type": "eval", "step": 4, **val}]) + "\n")
    plan.result_file.write_text(json.dumps({
        "mixture_id": plan.mixture_id, "seed": plan.seed, "weights": plan.weights, "overrides": plan.overrides,
        "final_step": 4, "tokens": 2048, "val": val, "tokenizer_path": "/b/tok.model", "build_dir": "/b",
        "val_samples": dict.fromkeys(SOURCES, 10), "train_tokens": TOKENS}))


def test_report_proposes_under_the_spec_limits_and_shows_the_confirmation(tmp_path: Path) -> None:
    spec = replace(_spec(dirichlet=24, prior=dict.fromkeys(SOURCES, 1.0), concentration=3),
                   config="tiny-stdlib.yaml", seeds=[0, 1], token_budget=TARGET // 10,
                   proposal=ProposalSpec(max_epochs={"tests": 1.0}, target_tokens=TARGET, surrogate="gp"))
    config = Path("configs/ablations/tiny-stdlib.yaml")
    plans = plan_runs(spec, config, tmp_path)
    rng = np.random.default_rng(0)
    for p in plans:
        w = np.array([p.weights[s] for s in SOURCES])
        _fake_run(p, _law(w[None], 0.5)[0] + rng.normal(0, 0.005, 3))
    write_report(spec, plans, tmp_path)
    summary = json.loads((tmp_path / "report.json").read_text())
    assert summary["proposal"]["tests"] == pytest.approx(0.1, abs=1e-4) and summary["proposal_surrogate"] == "gp"
    assert summary["proposal_epochs"][2] == pytest.approx(1.0, abs=1e-3) and summary["confirmation"] is None
    assert list(summary["binding"]) == ["max_epochs[tests]"]
    # Confirmation runs with the swarm's seeds (faked finished here: `run_one` is test_ablate.py's business).
    cplans = confirm_runs(spec, config, tmp_path, summary["proposal"])
    assert [c.seed for c in cplans] == [0, 1] and all("train.seed=1" in c.overrides for c in cplans[1:])
    truth = _law(np.array([[summary["proposal"][s] for s in SOURCES]]), 0.5)[0]
    for c, noise in zip(cplans, (0.002, -0.002)):
        _fake_run(c, truth + noise)
    report = write_report(spec, plans, tmp_path, config, confirm=True).read_text()
    assert json.loads((tmp_path / "report.json").read_text())["confirmation"][0] == pytest.approx(truth.mean())
    # The swarm was not held to the epoch limit, so the fair comparison is the best run that satisfies it.
    assert f"measured {truth.mean():.4f} ± 0.0020" in report and "best swarm run within the limits" in report
    assert "no worse than that run within seed noise" in report
    assert "`max_epochs[tests]`" in report and "(binds)" in report and "| gp (chosen) |" in report
    for png in ("predicted_vs_measured.png", "proposal_simplex.png"):
        assert f"]({png})" in report and (tmp_path / png).stat().st_size > 10_000
