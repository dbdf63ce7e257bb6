"""The ablation report: a markdown table, PNG plots and a recommended mixture (see ablate_fit.py for the model).

    <out>/report.md          table, upweighting effects, fit and its leave-one-out error, recommendation, Pareto
    <out>/curves.png         train and mean validation loss per mixture
    <out>/loss_vs_weight.png per-domain validation loss against that domain's weight, with the fitted curve
    <out>/pareto.png         per-domain losses pairwise, the Pareto-optimal mixtures marked
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from framework.base.errors import ConfigError
from framework.drivers.ablate import AblationSpec, RunPlan
from framework.drivers.ablate_fit import LOG_EPS, Fit, Recommendation, objective_values, pareto_mask, recommend
from framework.observe.plot import Curves, plot_runs, read_curves


@dataclass
class Table:
    """Results averaged over seeds, one row per mixture."""

    ids: list[str]
    W: np.ndarray
    """(n, k) weights."""
    L: np.ndarray
    """(n, k) final per-domain validation loss, mean over seeds."""
    L_std: np.ndarray
    seeds: int
    results: list[dict]


def collect(spec: AblationSpec, plans: list[RunPlan]) -> Table:
    """Read every finished run's result.json; refuse to report when runs are missing or saw different data."""
    missing = [p.path.name for p in plans if not p.finished()]
    if missing:
        raise ConfigError(f"ablation {spec.name!r}: runs {missing} have not finished; run `tessera ablate` again "
                          f"(finished runs are skipped) before the report")
    results = [json.loads(p.result_file.read_text()) for p in plans]
    fixed = {(r["tokenizer_path"], r["build_dir"], json.dumps(r["val_samples"], sort_keys=True)) for r in results}
    if len(fixed) != 1:
        raise ConfigError(f"ablation {spec.name!r}: runs used different tokenizers or held-out splits {fixed}; "
                          f"every run must read the same data build — rerun them from one cache")
    ids = sorted({p.mixture_id for p in plans})
    W, L, S = [], [], []
    for mid in ids:
        rows = [r for r in results if r["mixture_id"] == mid]
        W.append([rows[0]["weights"][s] for s in spec.sources])
        losses = np.array([[r["val"][f"val_loss/{s}"] for s in spec.sources] for r in rows])
        L.append(losses.mean(axis=0))
        S.append(losses.std(axis=0))
    return Table(ids, np.array(W), np.array(L), np.array(S), len(spec.seeds), results)


def _plot_loss_vs_weight(t: Table, f: Fit, sources: list[str], out: Path) -> None:
    import matplotlib.pyplot as plt

    k = len(sources)
    fig, axes = plt.subplots(1, k, figsize=(4 * k, 3.6), squeeze=False)
    for d, (ax, s) in enumerate(zip(axes[0], sources)):
        ax.scatter(t.W[:, d], t.L[:, d], color="C0", zorder=3, label="measured")
        for i, mid in enumerate(t.ids):
            ax.annotate(mid, (t.W[i, d], t.L[i, d]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if f.model == "log_linear":
            x = np.linspace(t.W[:, d].min(), t.W[:, d].max(), 100)
            a, b = f.coefs[d]
            ax.plot(x, a + b * np.log(x + LOG_EPS), color="C1", label=f"fit a + b·log(w+{LOG_EPS})")
        else:
            ax.scatter(t.W[:, d], f.predict(t.W)[:, d], marker="x", color="C1", label="linear fit")
        ax.set(xlabel=f"weight of {s}", ylabel=f"val loss {s}", title=f"{s}: LOO RMSE {f.loo_rmse[d]:.3f}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_pareto(t: Table, rec: Recommendation, sources: list[str], out: Path) -> None:
    import matplotlib.pyplot as plt

    pairs = [(i, j) for i in range(len(sources)) for j in range(i + 1, len(sources))] or [(0, 0)]
    front = pareto_mask(t.L)
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.8), squeeze=False)
    for ax, (i, j) in zip(axes[0], pairs):
        ax.scatter(t.L[~front, i], t.L[~front, j], color="0.6", label="dominated")
        ax.scatter(t.L[front, i], t.L[front, j], color="C3", label="Pareto-optimal (all domains)")
        pts = sorted(zip(t.L[:, i], t.L[:, j]))  # the 2-D front of this pair, drawn as a staircase
        stair, best = [], np.inf
        for x, y in pts:
            if y < best:
                stair.append((x, y))
                best = y
        ax.step(*zip(*stair), where="post", color="C3", lw=0.8, alpha=0.6)
        ax.scatter([rec.predicted[i]], [rec.predicted[j]], marker="*", s=160, color="C2", label="recommended (fit)")
        for n, mid in enumerate(t.ids):
            ax.annotate(mid, (t.L[n, i], t.L[n, j]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel=f"val loss {sources[i]}", ylabel=f"val loss {sources[j]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Pareto front of per-domain validation loss")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _fmt_w(w: np.ndarray, sources: list[str]) -> str:
    return ", ".join(f"{s} {x:.2f}" for s, x in zip(sources, w))


def _markdown(spec: AblationSpec, t: Table, f: Fit, rec: Recommendation) -> list[str]:
    src, r0 = spec.sources, t.results[0]
    obj = objective_values(t.L, src, spec.objective)
    head = "| mixture | " + " | ".join(f"w {s}" for s in src) + " | " + " | ".join(f"val {s}" for s in src) \
        + " | val mean | objective |"
    lines = [f"# Data-mixture ablation `{spec.name}`", "",
             f"{len(t.ids)} mixtures x {t.seeds} seed(s), {r0['tokens']:,} training tokens per run "
             f"({r0['final_step']} steps). Every run read the same tokenizer (`{Path(r0['tokenizer_path']).name}`) "
             f"and the same held-out split ({', '.join(f'{k}: {v}' for k, v in r0['val_samples'].items())} "
             f"validation samples). Objective: **{spec.objective}** validation loss.", "",
             "## Results (final validation loss, nats/token" + (", mean ± std over seeds)" if t.seeds > 1 else ")"),
             "", head, "|" + "---|" * (2 * len(src) + 3)]
    for i, mid in enumerate(t.ids):
        vals = [f"{t.L[i, d]:.4f}" + (f" ± {t.L_std[i, d]:.4f}" if t.seeds > 1 else "") for d in range(len(src))]
        lines.append(f"| {mid} | " + " | ".join(f"{w:.2f}" for w in t.W[i]) + " | " + " | ".join(vals)
                     + f" | {t.L[i].mean():.4f} | {obj[i]:.4f} |")
    lines += ["", "## Effect of upweighting each domain (measured)", "",
              "| domain | from mixture (weight) | to mixture (weight) | its val loss: from -> to | change |",
              "|---|---|---|---|---|"]
    for d, s in enumerate(src):
        lo, hi = int(np.argmin(t.W[:, d])), int(np.argmax(t.W[:, d]))
        lines.append(f"| {s} | {t.ids[lo]} ({t.W[lo, d]:.2f}) | {t.ids[hi]} ({t.W[hi, d]:.2f}) | "
                     f"{t.L[lo, d]:.4f} -> {t.L[hi, d]:.4f} | {t.L[hi, d] - t.L[lo, d]:+.4f} |")
    model = "L_d = a_d + b_d·log(w_d + 0.01)" if f.model == "log_linear" else "L_d = a_d + Σ_j b_dj·w_j"
    lines += ["", f"## Fit: {model}", "",
              "Leave-one-mixture-out RMSE of the fit, against the constant predictor (mean of the other mixtures):",
              "", "| domain | coefficients | LOO RMSE fit | LOO RMSE constant |", "|---|---|---|---|"]
    for d, s in enumerate(src):
        lines.append(f"| {s} | {', '.join(f'{c:+.4f}' for c in f.coefs[d])} | {f.loo_rmse[d]:.4f} | "
                     f"{f.baseline_rmse[d]:.4f} |")
    verdict = ("the fit beats the constant predictor" if rec.objective_loo_rmse < rec.objective_baseline_rmse
               else "the fit does NOT beat the constant predictor — treat the recommendation as unsupported")
    lines += ["", f"## Recommended mixture ({spec.objective} objective)", "",
              f"**{_fmt_w(rec.weights, src)}** — predicted {spec.objective} loss {rec.predicted_objective:.4f} "
              f"± {rec.objective_loo_rmse:.4f} (leave-one-out RMSE of the fitted objective; constant predictor: "
              f"{rec.objective_baseline_rmse:.4f}; {verdict}).",
              f"Predicted per-domain loss: {', '.join(f'{s} {x:.4f}' for s, x in zip(src, rec.predicted))}. "
              f"Searched inside the box of tried weights only (no extrapolation).",
              f"Best tried run for comparison: {t.ids[rec.best_tried]} ({_fmt_w(t.W[rec.best_tried], src)}), "
              f"measured {obj[rec.best_tried]:.4f}.", "", "## Pareto front", "",
              "Not dominated in every domain: " + ", ".join(m for m, k in zip(t.ids, pareto_mask(t.L)) if k) + ".",
              "", "![loss curves](curves.png)", "", "![loss vs weight](loss_vs_weight.png)", "",
              "![Pareto front](pareto.png)", ""]
    return lines


def _seed_std(spec: AblationSpec, t: Table) -> float:
    """Mean over mixtures of the objective's standard deviation over seeds (nan with one seed)."""
    if t.seeds < 2:
        return float("nan")
    per = [objective_values(np.array([[r["val"][f"val_loss/{s}"] for s in spec.sources] for r in t.results
                                      if r["mixture_id"] == mid]), spec.sources, spec.objective).std()
           for mid in t.ids]
    return float(np.mean(per))


def write_report(spec: AblationSpec, plans: list[RunPlan], out: str | Path, config_path: Path | None = None,
                 confirm: bool = False) -> Path:
    """Collect the finished runs and write report.md and its PNGs into `out`; with `confirm` (and the training
    config), first train the proposal at proxy scale with the swarm's seeds. Returns report.md."""
    import matplotlib

    from framework.drivers import ablate_proposal_report as pr
    from framework.drivers.ablate import confirm_runs, run_one

    matplotlib.use("Agg")
    out = Path(out)
    t = collect(spec, plans)
    f, rec = recommend(t.W, t.L, spec.sources, spec.objective, spec.regression)
    curves: list[Curves] = []
    colors = []
    for p in plans:
        weights = _fmt_w(np.array([p.weights[s] for s in spec.sources]), spec.sources)
        curves.append(read_curves(p.path, f"{p.mixture_id} s{p.seed} ({weights})"))
        colors.append(f"C{t.ids.index(p.mixture_id) % 10}")
    plot_runs(curves, out / "curves.png", title=f"ablation {spec.name}", smooth_window=5, colors=colors)
    _plot_loss_vs_weight(t, f, spec.sources, out / "loss_vs_weight.png")
    _plot_pareto(t, rec, spec.sources, out / "pareto.png")
    lines = _markdown(spec, t, f, rec)
    summary = {"ids": t.ids, "weights": t.W.tolist(), "val_loss": t.L.tolist(), "sources": spec.sources,
               "recommended": dict(zip(spec.sources, rec.weights.tolist())),
               "predicted_objective": rec.predicted_objective, "objective_loo_rmse": rec.objective_loo_rmse,
               "objective_baseline_rmse": rec.objective_baseline_rmse, "loo_rmse": f.loo_rmse.tolist()}
    if len(t.ids) > len(spec.sources):  # the proposal needs a fit with leave-one-out error
        res = pr.make_proposal(spec, t.W, t.L, t.results)
        proposed = dict(zip(spec.sources, res.proposal.weights.tolist()))
        confirmed = None
        if confirm and config_path is not None:
            cplans = confirm_runs(spec, config_path, out, proposed)
            for c in cplans:
                if not c.finished():
                    run_one(c, config_path)
            confirmed = pr.confirmation(spec, cplans)
        lines += pr.markdown(spec, t.ids, t.W, res, _seed_std(spec, t), confirmed)
        pr.plot_predicted(res, t.ids, out / "predicted_vs_measured.png")
        pr.plot_simplex(res, t.W, spec.sources, out / "proposal_simplex.png")
        summary |= {"proposal": proposed, "proposal_predicted": res.proposal.mean, "proposal_std": res.proposal.std,
                    "proposal_surrogate": res.chosen.name, "proposal_epochs": res.proposal.epochs.tolist(),
                    "binding": {b.limit: b.gain for b in res.proposal.binding},
                    "surrogate_loo_rmse": {s.name: s.loo_rmse for s in res.surrogates},
                    "confirmation": confirmed}
    report = out / "report.md"
    report.write_text("\n".join(lines))
    (out / "report.json").write_text(json.dumps(summary, indent=1))
    return report
