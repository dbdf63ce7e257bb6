"""The online mixture rule: DoReMi's exponentiated-gradient step on per-domain excess loss.

Xie et al. 2023, "DoReMi: Optimizing Data Mixtures Speeds Up Language Model Pretraining" (arXiv:2305.10429),
Algorithm 1: with excess loss lambda_d = max(L_d - L_ref_d, 0) of each domain d,

    w'_d = w_d * exp(eta * lambda_d)
    w_d  <- (1 - c) * w'_d / sum_j w'_j + c / D

DoReMi takes a step per training step on the proxy's per-example losses and trains the final model on the
average weights; Tessera applies the rule every `data.online.interval` steps of the run itself, on held-out
losses (the online use ODM, Albalak et al. 2023, arXiv:2312.02406, also makes of a loss-driven rule).

Determinism across world sizes: the losses come from the same held-out samples at every world size, but their
float sums differ in the last bits with the reduction order. They are snapped to a grid of `round_to` first (as
integer multiples), so runs on 1 and on N data ranks compute bitwise the same weights unless a loss falls within
that last-bit noise of a grid boundary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from framework.base.errors import DataError


@dataclass(frozen=True)
class MixtureUpdate:
    """One update: the rounded losses it saw, their excess over the reference, and the weights it chose."""

    losses: dict[str, float]
    excess: dict[str, float]
    weights: dict[str, float]


def doremi_update(weights: Mapping[str, float], losses: Mapping[str, float], *, reference: Mapping[str, float],
                  step_size: float, smoothing: float, round_to: float) -> MixtureUpdate:
    """DoReMi's step (module docstring) from `weights` given each domain's held-out loss.

    Args:
        weights: Current weights of the mixed domains (normalized here).
        losses: Held-out loss per domain, the same keys as `weights`.
        reference: Reference loss per domain; a missing domain has reference 0.
        step_size: eta.
        smoothing: c, the share of the uniform mixture in the result.
        round_to: Grid the losses are snapped to before anything else.

    Raises:
        DataError: a loss is not finite, or the domains of `weights` and `losses` differ.
    """
    names = sorted(weights)
    if sorted(losses) != names:
        raise DataError(f"online mixing got losses for {sorted(losses)} but mixes {names}")
    bad = {n: v for n, v in losses.items() if not math.isfinite(v)}
    if bad:
        raise DataError(f"online mixing: held-out loss {bad} is not finite; the run diverged (lower train.lr) "
                        f"before the weight update")
    snapped = {n: round(losses[n] / round_to) * round_to for n in names}
    excess = {n: max(snapped[n] - float(reference.get(n, 0.0)), 0.0) for n in names}
    total = sum(weights.values())
    # Subtracting the largest exponent keeps exp() finite; the normalization cancels it.
    top = max(step_size * excess[n] for n in names)
    raw = {n: weights[n] / total * math.exp(step_size * excess[n] - top) for n in names}
    norm = sum(raw.values())
    new = {n: (1 - smoothing) * raw[n] / norm + smoothing / len(names) for n in names}
    return MixtureUpdate(losses=snapped, excess=excess, weights=new)
