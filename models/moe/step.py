"""What an engine calls around a step of an MoE model — the whole contract, six functions:

    set_aux_loss_scale(parts, 1 / n_micro)      # before the micro-batches (x the fp16 loss scale, if any)
    ... forward / backward per micro-batch ...  # the aux losses reach the gradients by themselves
    aux = collect_aux_loss(parts)               # optional: detached aux loss of the last forward, to report
    optimizer.step()
    update_routing_bias(parts, reduce)          # after the optimizer step (aux-loss-free balancing), or
    discard_routing_counts(parts)               # instead, when the step is skipped (it never happened)
    metrics = moe_metrics(parts, reduce)        # per-layer load statistics of the step, for metrics.jsonl

`reduce` sums a tensor over the data ranks (dp_replicate x dp_shard, *not* tp or pp); None on one process.
With pipeline parallelism each stage reports its own layers; the engine merges the dicts (keys are distinct).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from models.moe.layer import STAT_FIELDS, MoE

Reduce = Callable[[torch.Tensor], torch.Tensor]

# Per-expert token counts are logged as separate keys only up to this many experts (metrics stay readable).
MAX_LOGGED_EXPERTS = 64


def moe_layers(parts: Iterable[nn.Module]) -> Iterator[tuple[str, MoE]]:
    """(layer name, MoE module) for every MoE layer, named by the canonical FQN of its block (`layers.3`)."""
    from models.init import canonical_fqn

    for part in parts:
        for fqn, module in part.named_modules():
            if isinstance(module, MoE):
                yield canonical_fqn(fqn).removesuffix(".feed_forward"), module


def set_aux_loss_scale(parts: Iterable[nn.Module], scale: float) -> None:
    """The gradient each forward's aux loss receives: 1 / micro-batches (x the loss scale under fp16)."""
    for _, moe in moe_layers(parts):
        moe.aux_loss_scale = scale


def collect_aux_loss(parts: Iterable[nn.Module]) -> torch.Tensor:
    """Sum of the (coefficient-weighted) aux + z losses of every MoE layer's last forward, detached."""
    total = torch.zeros(())
    for _, moe in moe_layers(parts):
        if moe.last_aux_loss is not None:
            total = total + moe.last_aux_loss.cpu()
    return total


@torch.no_grad()
def update_routing_bias(parts: Iterable[nn.Module], reduce: Reduce | None = None) -> None:
    """Apply the auxiliary-loss-free bias update of every layer from the step's (all-reduced) expert counts."""
    for _, moe in moe_layers(parts):
        rate = moe.moe_cfg.bias_update_rate
        if rate <= 0:
            continue
        counts = moe.bias_counts if moe.bias_counts is not None else torch.zeros(moe.n_experts)
        counts = counts.to(moe.router.expert_bias.device)
        if reduce is not None:
            counts = reduce(counts)
        moe.router.update_bias(counts, rate)
        moe.bias_counts = None


def discard_routing_counts(parts: Iterable[nn.Module]) -> None:
    """Forget the expert counts of a skipped step, so the next bias update sees only the next step's tokens."""
    for _, moe in moe_layers(parts):
        moe.bias_counts = None


def moe_stats(parts: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """Raw per-layer sums of the step (float64 vectors, see `STAT_FIELDS`), and reset them."""
    out: dict[str, torch.Tensor] = {}
    for name, moe in moe_layers(parts):
        vec = moe.step_stats if moe.step_stats is not None else torch.zeros(moe.n_experts + len(STAT_FIELDS),
                                                                            dtype=torch.float64)
        out[name] = vec
        moe.step_stats = None
    return out


def layer_coefs(moe: MoE) -> tuple[float, float, int, int]:
    """What `format_moe_metrics` needs of a layer's config: (aux_loss_coef, z_loss_coef, top_k, n_groups)."""
    cfg = moe.moe_cfg
    return cfg.aux_loss_coef, cfg.z_loss_coef, cfg.top_k, cfg.n_groups


def format_moe_metrics(stats: dict[str, torch.Tensor], coefs: dict[str, tuple[float, float, int, int]]
                       ) -> dict[str, float]:
    """metrics.jsonl entries from summed stats: per layer tokens per expert (pre-drop assignments), max/mean
    load imbalance, dropped fraction, balancing and z losses (means over token groups), and with group-limited
    routing the mean number of expert groups a token's experts span; plus model totals."""
    out: dict[str, float] = {}
    aux_total = 0.0
    worst = 0.0
    for name, vec in stats.items():
        n_experts = vec.numel() - len(STAT_FIELDS)
        counts = vec[:n_experts]
        dropped, assigned, lb, z, groups, span = vec[n_experts:].tolist()
        groups = max(groups, 1.0)
        imbalance = float(counts.max() / counts.mean()) if counts.sum() > 0 else 0.0
        worst = max(worst, imbalance)
        prefix = f"moe/{name}" if name else "moe"
        if n_experts <= MAX_LOGGED_EXPERTS:
            out.update({f"{prefix}/tokens_e{e}": float(c) for e, c in enumerate(counts.tolist())})
        out[f"{prefix}/imbalance"] = imbalance
        out[f"{prefix}/dropped_frac"] = dropped / assigned if assigned else 0.0
        out[f"{prefix}/lb_loss"] = lb / groups
        out[f"{prefix}/z_loss"] = z / groups
        aux_coef, z_coef, top_k, n_groups = coefs[name]
        if n_groups > 1:  # tokens = assignments / top_k
            out[f"{prefix}/groups_per_token"] = span * top_k / assigned if assigned else 0.0
        aux_total += aux_coef * lb / groups + z_coef * z / groups
    if stats:
        out["moe/aux_loss"] = aux_total
        out["moe/imbalance_max"] = worst
    return out


def moe_metrics(parts: list[nn.Module], reduce: Reduce | None = None) -> dict[str, float]:
    """This step's MoE metrics (summed over the data ranks by `reduce`), and reset the accumulators.

    `moe/aux_loss` is the aux + z loss added to the training loss, averaged over token groups — the figure to
    compare with a 1-process run.
    """
    stats = moe_stats(parts)
    if reduce is not None:
        stats = {k: reduce(v) for k, v in stats.items()}
    return format_moe_metrics(stats, {name: layer_coefs(m) for name, m in moe_layers(parts)})
