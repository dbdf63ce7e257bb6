"""The report's proposal part: every surrogate's honest error, the proposal under the spec's limits, its
confirmation runs, and two plots.

    <out>/predicted_vs_measured.png  each tried mixture's objective predicted by fits that never saw it
    <out>/proposal_simplex.png       the swarm, the best run and the proposal on the simplex (ternary for three
                                     sources, pairwise weight planes otherwise), over the surrogate's mean
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from framework.drivers.ablate import AblationSpec, RunPlan
from framework.drivers.ablate_fit import objective_values
from framework.drivers.ablate_propose import Proposal, feasible, limits, propose
from framework.drivers.ablate_reuse import earlier_rows
from framework.drivers.ablate_surrogate import Surrogate, all_surrogates, best


@dataclass(frozen=True)
class ProposalResult:
    surrogates: list[Surrogate]
    chosen: Surrogate
    proposal: Proposal
    target_tokens: int
    measured: np.ndarray
    """(n,) measured objective of the tried mixtures."""
    allowed: np.ndarray
    """(n,) which tried mixtures satisfy the proposal's limits (the fair comparison for the confirmation)."""
    reused: tuple[str, ...] = ()
    """Labels of the earlier swarms' mixtures that joined the per-domain fits."""


def train_tokens(results: list[dict]) -> dict[str, int]:
    """Training tokens per source as the runs recorded them (every run reads the same build)."""
    return dict(results[0].get("train_tokens", {})) if results else {}


def make_proposal(spec: AblationSpec, W: np.ndarray, L: np.ndarray, results: list[dict]) -> ProposalResult:
    """Fit every surrogate the swarm allows (with spec.reuse's earlier runs in the per-domain fits), pick one
    (spec.proposal.surrogate) and propose under the limits."""
    src, ps = spec.sources, spec.proposal
    We, Le, labels = earlier_rows(spec.reuse, src, results[0]["tokenizer_path"], results[0]["val_samples"]) \
        if spec.reuse else (np.zeros((0, len(src))), np.zeros((0, len(src))), [])
    sur = all_surrogates(W, L, src, spec.objective, (We, Le))
    chosen = best(sur, ps.surrogate)
    tokens = train_tokens(results)
    target = ps.target_tokens or spec.token_budget
    lim = limits(ps, src, spec.token_budget, tokens, spec.mixtures.prior, tried=W)
    prop = propose(chosen.predict, lim, src, target, tokens, risk=ps.risk)
    return ProposalResult(sur, chosen, prop, target, objective_values(L, src, spec.objective), feasible(W, lim),
                          tuple(labels))


def confirmation(spec: AblationSpec, plans: list[RunPlan]) -> tuple[float, float] | None:
    """Mean and std over seeds of the confirmation runs' measured objective (None when they did not run)."""
    done = [json.loads(p.result_file.read_text()) for p in plans if p.finished()]
    if not done or len(done) != len(plans):
        return None
    L = np.array([[r["val"][f"val_loss/{s}"] for s in spec.sources] for r in done])
    obj = objective_values(L, spec.sources, spec.objective)
    return float(obj.mean()), float(obj.std())


def markdown(spec: AblationSpec, ids: list[str], W: np.ndarray, res: ProposalResult, seed_std: float,
             confirmed: tuple[float, float] | None) -> list[str]:
    src, p = spec.sources, res.proposal
    lines = ["## Surrogates of the objective", "",
             "Leave-one-mixture-out RMSE of each model of the objective, against the constant predictor:", "",
             "| surrogate | LOO RMSE | constant LOO RMSE | beats constant |", "|---|---|---|---|"]
    for s in res.surrogates:
        mark = " (chosen)" if s is res.chosen else ""
        lines.append(f"| {s.name}{mark} | {s.loo_rmse:.4f} | {s.baseline_rmse:.4f} | "
                     f"{'yes' if s.loo_rmse < s.baseline_rmse else 'NO'} |")
    if res.reused:
        lines += ["", f"Reused {len(res.reused)} mixtures of earlier ablations ({', '.join(spec.reuse)}) in the "
                  f"per-domain fits, for the domains they evaluated (the linear fit: only those on this simplex; the "
                  f"GP: none); every leave-one-out error above is on this swarm's mixtures."]
    ww = ", ".join(f"{s} {x:.3f}" for s, x in zip(src, p.weights))
    where = "inside the swarm's hull (trust region)" if spec.proposal.trust_region else "whole simplex"
    lines += ["", f"## Proposal ({res.chosen.name}, {where}, target {res.target_tokens:,} tokens)", "",
              f"**{ww}** — predicted {spec.objective} loss {p.mean:.4f} ± {p.std:.4f} (1 sigma).",
              "Epochs of each source at the target budget: " + ", ".join(
                  f"{s} {e:.2f}" for s, e in zip(src, p.epochs)) + ".",
              "Without limits the surrogate's minimum is " + ", ".join(
                  f"{s} {x:.3f}" for s, x in zip(src, p.unconstrained)) + f" (predicted {p.unconstrained_mean:.4f})."]
    if p.binding:
        lines.append("Limits the proposal touches (dropping one lowers the predicted objective by): " + "; ".join(
            f"`{b.limit}` {b.gain:+.4f}{' (binds)' if b.gain > 1e-6 else ' (does not bind)'}" for b in p.binding)
            + ".")
    else:
        lines.append("No limit binds: the proposal is the surrogate's minimum over the simplex.")
    within = np.where(res.allowed, res.measured, np.inf)
    i = int(np.argmin(within)) if res.allowed.any() else int(np.argmin(res.measured))
    what = "best swarm run within the limits" if res.allowed.any() else "best swarm run (none is within the limits)"
    if res.allowed.any() and not res.allowed.all():
        j = int(np.argmin(res.measured))
        what += f" ({int(res.allowed.sum())} of {len(ids)}; the best overall, {ids[j]}, measured {res.measured[j]:.4f})"
    lines += ["", "## Confirmation", ""]
    if confirmed is None:
        lines.append("Not run (`--no-confirm`, or the confirmation runs have not finished).")
    else:
        m, m_std = confirmed
        gap = m - res.measured[i]
        noise = max(np.nan_to_num(seed_std), m_std)
        verdict = ("one seed, so seed noise is not measured: rerun with two or more seeds for a verdict" if not noise
                   else "no worse than that run within seed noise" if gap <= 2 * noise
                   else "WORSE than that run beyond seed noise")
        lines.append(f"The proposal trained like every proxy ({len(spec.seeds)} seed(s)) measured {m:.4f}"
                     + (f" ± {m_std:.4f}" if len(spec.seeds) > 1 else "")
                     + f"; predicted {p.mean:.4f} ± {p.std:.4f}; {what}: {ids[i]} measured {res.measured[i]:.4f} "
                     f"(gap {gap:+.4f}; seed noise {seed_std:.4f}): {verdict}.")
    lines += ["", "![predicted vs measured](predicted_vs_measured.png)", "",
              "![proposal on the simplex](proposal_simplex.png)", ""]
    return lines


def plot_predicted(res: ProposalResult, ids: list[str], out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.6))
    y = res.measured
    for n, s in enumerate(res.surrogates):
        ax.scatter(y, s.loo_pred, s=18, color=f"C{n}", label=f"{s.name} (LOO RMSE {s.loo_rmse:.4f})")
    lo, hi = float(min(y.min(), *(s.loo_pred.min() for s in res.surrogates))), float(y.max())
    ax.plot([lo, hi], [lo, hi], color="0.5", lw=0.8)
    ax.set(xlabel="measured objective", ylabel="predicted without seeing that mixture",
           title="leave-one-out predictions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _ternary(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return W[:, 1] + 0.5 * W[:, 2], W[:, 2] * np.sqrt(3) / 2


def plot_simplex(res: ProposalResult, W: np.ndarray, sources: list[str], out: Path) -> None:
    import matplotlib.pyplot as plt

    from framework.drivers.ablate import simplex_grid

    p, k = res.proposal, len(sources)
    best_run = W[int(np.argmin(res.measured))]
    if k == 3:
        fig, ax = plt.subplots(figsize=(5.6, 5))
        grid = simplex_grid(3, 0.02)
        tri = ax.tricontourf(*_ternary(grid), res.chosen.predict(grid)[0], levels=20, cmap="viridis")
        fig.colorbar(tri, ax=ax, label=f"{res.chosen.name} predicted objective")
        ax.scatter(*_ternary(W), s=14, color="w", edgecolors="k", label="swarm")
        ax.scatter(*_ternary(best_run[None]), marker="s", s=60, color="C1", label="best swarm run")
        ax.scatter(*_ternary(p.weights[None]), marker="*", s=200, color="C3", label="proposal")
        for (x, y), name in zip([(0, 0), (1, 0), (0.5, np.sqrt(3) / 2)], sources):
            ax.annotate(name, (x, y), fontsize=9, ha="center", va="top" if y == 0 else "bottom")
        ax.set_axis_off()
        ax.legend(fontsize=7, loc="upper right")
    else:
        pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
        fig, axes = plt.subplots(1, len(pairs), figsize=(3.6 * len(pairs), 3.4), squeeze=False)
        for ax, (i, j) in zip(axes[0], pairs):
            ax.scatter(W[:, i], W[:, j], s=12, color="0.5", label="swarm")
            ax.scatter([best_run[i]], [best_run[j]], marker="s", color="C1", label="best run")
            ax.scatter([p.weights[i]], [p.weights[j]], marker="*", s=160, color="C3", label="proposal")
            ax.set(xlabel=f"w {sources[i]}", ylabel=f"w {sources[j]}", xlim=(0, 1), ylim=(0, 1))
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
