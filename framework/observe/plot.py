"""`tessera plot RUN... [--out PNG]`: the loss curves of several runs in one PNG; `--weights`: an online-mixing
run's mixture weights over time (matplotlib, no display)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.base.errors import ConfigError


@dataclass
class Curves:
    """What a run's metrics.jsonl holds for plotting."""

    name: str
    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    val: dict[str, list[float]] = field(default_factory=dict)
    """val_loss/<domain> series, aligned with eval_steps."""


def read_curves(run_dir: str | Path, name: str | None = None) -> Curves:
    """Train loss and validation losses of the run at `run_dir` (its metrics.jsonl)."""
    from framework.base.run_dir import RunDir

    run = RunDir(run_dir)
    if not run.metrics_file.is_file():
        raise ConfigError(f"{run.metrics_file} does not exist; pass run directories (they hold metrics.jsonl), "
                          f"e.g. runs/smoke")
    curves = Curves(name or run.path.name)
    for rec in run.read_metrics(kind=None):
        if rec.get("type") == "train":
            curves.steps.append(rec["step"])
            curves.tokens.append(rec.get("tokens", 0))
            curves.loss.append(rec["loss"])
        elif rec.get("type") == "eval":
            curves.eval_steps.append(rec["step"])
            for key, value in rec.items():
                if key.startswith("val_loss/"):
                    curves.val.setdefault(key.split("/", 1)[1], []).append(value)
    return curves


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs: list[Curves], out: str | Path, title: str = "", smooth_window: int = 1,
              colors: list[str] | None = None) -> Path:
    """Train loss per step (left) and mean validation loss (right) of every run; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, c in enumerate(runs):
        color = colors[i] if colors else f"C{i % 10}"
        ax_train.plot(c.steps, smooth(c.loss, smooth_window), color=color, lw=1.2, label=c.name)
        if c.eval_steps and "mean" in c.val:
            ax_val.plot(c.eval_steps, c.val["mean"], "o-", color=color, lw=1.2, ms=3, label=c.name)
    ax_train.set(xlabel="step", ylabel="train loss (nats/token)", title="train loss"
                 + (f" (moving average of {smooth_window})" if smooth_window > 1 else ""))
    ax_val.set(xlabel="step", ylabel="mean validation loss", title="validation loss (mean over domains)")
    return _save(fig, (ax_train, ax_val), out, title)


def _save(fig: Any, axes: tuple[Any, ...], out: str | Path, title: str) -> Path:
    """Grid and legend on every axis that has lines, the title, and the PNG at `out`."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines or ax.collections:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@dataclass
class MixtureWeights:
    """What an online-mixing run's metrics.jsonl holds: the weights in force at every step and each update's
    held-out losses (`mix/<domain>` of train records, `mix_loss/<domain>` of mixing records)."""

    steps: list[int] = field(default_factory=list)
    weights: dict[str, list[float]] = field(default_factory=dict)
    update_steps: list[int] = field(default_factory=list)
    losses: dict[str, list[float]] = field(default_factory=dict)


def read_weights(run_dir: str | Path) -> MixtureWeights:
    """The mixture weights over time of the run at `run_dir`.

    Raises:
        ConfigError: the run logged no weights (it did not train with data.mixing=online).
    """
    from framework.base.run_dir import RunDir

    out = MixtureWeights()
    for rec in RunDir(run_dir).read_metrics(kind=None):
        if rec.get("type") == "train" and any(k.startswith("mix/") for k in rec):
            out.steps.append(rec["step"])
            for key, value in rec.items():
                if key.startswith("mix/"):
                    out.weights.setdefault(key.split("/", 1)[1], []).append(value)
        elif rec.get("type") == "mixing":
            out.update_steps.append(rec["step"])
            for key, value in rec.items():
                if key.startswith("mix_loss/"):
                    out.losses.setdefault(key.split("/", 1)[1], []).append(value)
    if not out.steps:
        raise ConfigError(f"{run_dir} logged no mixture weights (mix/<domain>); only a run with data.mixing=online "
                          f"does")
    return out


def plot_weights(run_dir: str | Path, out: str | Path, title: str = "") -> Path:
    """Stacked weights per step (left) and the held-out loss of each domain at every update (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mw = read_weights(run_dir)
    names = sorted(mw.weights)
    fig, (ax_w, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_w.stackplot(mw.steps, [mw.weights[n] for n in names], labels=names, alpha=0.85)
    ax_w.set(xlabel="step", ylabel="weight", ylim=(0, 1), title="mixture weights in force (stacked)")
    for n in names:
        if n in mw.losses:
            ax_l.plot(mw.update_steps, mw.losses[n], "o-", ms=3, lw=1.2, label=n)
    ax_l.set(xlabel="step", ylabel="held-out loss (rounded)", title="per-domain loss at each update")
    return _save(fig, (ax_w, ax_l), out, title)
