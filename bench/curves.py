"""Loss curves of a bench's runs in one PNG (the benches that compare optimizers or numerics on one stream)."""

from __future__ import annotations


def plot_loss_curves(curves: dict[str, list[float]], png: str, title: str) -> None:
    """One line per run (its training loss per step), saved to `png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(losses, label=name, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
