"""Multi-token prediction (DeepSeek-V3, DeepSeek-AI 2024, sec. 2.2): D sequential modules after the main model.

Module k (1..D) predicts, at position i, the token k + 1 places after the main head's target (t_{i+k+1}) from
the previous depth's hidden state h^{k-1} (the main model's final-normed output for k = 1) and the embedding of
token t_{i+k}, keeping the causal chain of the paper:

    h'^k = M_k [hnorm(h^{k-1}); enorm(Emb(t_{i+k}))]     h^k = TRM_k(h'^k)     P^k = OutHead(norm_k(h^k))
    L_MTP = lambda / D * sum_k CE(P^k, t_{i+k+1}) over the positions where t_{i+k+1} exists

Emb and OutHead are the main model's (shared, as the paper); M_k is `eh_proj`, TRM_k one transformer block and
norm_k its own final norm (DeepSeek-V3's HF names: enorm, hnorm, eh_proj, shared_head.norm). Since t_{i+1} is the
main target y_i, module k reads its input tokens from the labels shifted by k - 1 and its targets from the labels
shifted by k: every row keeps all T positions (so sequence parallelism's equal shards and one compiled shape hold)
and the last k positions of depth k are ignored in the loss. Under context parallelism a rank holds two chunks of
each row, and the shifted labels reach past them: the engine shifts the whole row first (`mtp_label_stack`) and cuts
the stack as the inputs (framework/parallel/context.py); each rank's mean is weighted by its share of the row's
predicted positions (`seq_shards`), so the mean over the cp ranks is the whole row's mean as on one process.

The loss is not returned through the model's output: like MoE's aux losses (models/moe/losses.py) it is attached
to the logits with `AuxLossInjector`, receiving gradient `loss_scale` (1 / micro-batches, times an fp16 loss
scale) when the main loss's backward reaches the logits, so every engine's loss path stays as it is. Each depth's
loss of the step is accumulated, detached, for metrics (`mtp/loss_k`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.kv_cache import LayerKVCache
from models.layers import build_norm

IGNORE = -100


def mtp_targets(labels_BT: torch.Tensor, shift: int) -> torch.Tensor:
    """`labels` moved `shift` places left, the vacated last positions IGNORE (no token there to predict)."""
    out = torch.full_like(labels_BT, IGNORE)
    out[:, :labels_BT.shape[1] - shift] = labels_BT[:, shift:]
    return out


def mtp_label_stack(labels_BT: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, T, depth + 1): [..., j] is `labels` shifted by j (`mtp_targets`), what depth j reads as input tokens
    (j < depth) and depth j - 1 predicts (j > 0); built on whole rows, so it can be cut into cp chunks after."""
    return torch.stack([mtp_targets(labels_BT, j) for j in range(depth + 1)], dim=-1)


class MTPModule(nn.Module):
    """One prediction depth: projection of [hnorm(h); enorm(emb)], one transformer block, its final norm."""

    def __init__(self, cfg: ModelConfig, depth: int, make_block: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        self.enorm = build_norm(cfg)
        self.hnorm = build_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)
        self.block = make_block(cfg, cfg.n_layers + depth - 1)
        self.norm = build_norm(cfg)

    def forward(self, h_BTD: torch.Tensor, emb_BTD: torch.Tensor, rope: torch.Tensor,
                attn_mask: torch.Tensor | None, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        """`kv_cache`: drafting in generation (framework/infer/speculative.py) keeps this depth's keys/values."""
        x = self.eh_proj(torch.cat([self.hnorm(h_BTD), self.enorm(emb_BTD)], dim=-1))
        if kv_cache is None:  # the training call stays (x, rope, mask), as the decoder's blocks
            return self.block(x, rope, attn_mask)
        return self.block(x, rope, attn_mask, kv_cache)


class MultiTokenPrediction(nn.Module):
    """The D modules (`depths`, keyed "1".."D") and the step's per-depth losses; `make_block(cfg, layer_id)`
    builds a transformer block (the decoder's `Block`, handed in so this module does not import the decoder)."""

    def __init__(self, cfg: ModelConfig, make_block: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        self.weight = cfg.mtp_loss_weight
        self.depths = nn.ModuleDict({str(k): MTPModule(cfg, k, make_block) for k in range(1, cfg.mtp_depth + 1)})
        self.loss_scale = 1.0
        """Gradient the MTP loss of one forward receives (set per step, as `set_aux_loss_scale` for MoE)."""
        self.step_losses: torch.Tensor | None = None
        """Sum over this step's forwards of each depth's mean loss (detached, (D,)); `forwards` counts them."""
        self.forwards = 0
        self.seq_shards = 1
        """Ranks each sequence is split over (parallel.cp; set by framework/parallel/context.py's `install`)."""

    def forward(self, logits_BTV: torch.Tensor, h_BTD: torch.Tensor, labels_BT: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor], head: Callable[[torch.Tensor], torch.Tensor],
                rope: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """The main logits, unchanged, carrying L_MTP's gradient (see the module docstring).

        `labels_BT`: the (B, T) labels, or under cp this rank's positions of `mtp_label_stack` of the whole rows
        (B, L, D + 1)."""
        stack = labels_BT if labels_BT.dim() == 3 else mtp_label_stack(labels_BT, len(self.depths))
        losses = []
        for k, depth in self.depths.items():
            module = cast(MTPModule, depth)
            shift = int(k)
            h_BTD = module(h_BTD, embed(stack[..., shift - 1].clamp_min(0)), rope, attn_mask)
            logits = head(module.norm(h_BTD))
            targets = stack[..., shift]
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE))
        per_depth = torch.stack(losses)
        if hasattr(per_depth, "to_local"):  # vocab-parallel logits (loss_parallel): a replicated DTensor loss
            per_depth = per_depth.to_local()
        if self.seq_shards > 1:
            per_depth = per_depth * self._row_share(stack)
        detached = per_depth.detach().float().cpu()
        self.step_losses = detached if self.step_losses is None else self.step_losses + detached
        self.forwards += 1
        from models.moe.losses import AuxLossInjector  # the package loads MoE's modules: only MTP runs pay for it

        total = per_depth.mean() * self.weight
        return AuxLossInjector.apply(logits_BTV, total, self.loss_scale)  # type: ignore[no-any-return]

    def _row_share(self, stack_BLS: torch.Tensor) -> torch.Tensor:
        """(D,) per depth: this rank's predicted positions x cp / the whole rows' (B x (T - k)); a rank's mean
        times it, averaged over the cp ranks, is the mean over the whole rows (the last k positions of a row sit
        on one rank, so the ranks' counts differ)."""
        b, local = stack_BLS.shape[:2]
        mine = (stack_BLS[..., 1:] != IGNORE).sum(dim=(0, 1))
        whole = b * (local * self.seq_shards - torch.arange(1, stack_BLS.shape[-1], device=stack_BLS.device))
        return (mine * self.seq_shards / whole).to(torch.float32)

    def take_metrics(self) -> dict[str, float]:
        """`mtp/loss_k` (mean over this step's forwards) per depth, and reset."""
        if self.step_losses is None:
            return {}
        out = {f"mtp/loss_{i + 1}": float(v) / self.forwards for i, v in enumerate(self.step_losses)}
        self.step_losses, self.forwards = None, 0
        return out


def mtp_modules(parts: list[nn.Module]) -> list[MultiTokenPrediction]:
    return [m for part in parts for m in part.modules() if isinstance(m, MultiTokenPrediction)]


def set_mtp_loss_scale(parts: list[nn.Module], scale: float) -> None:
    """The gradient each forward's MTP loss receives: 1 / micro-batches (x the fp16 loss scale, if any)."""
    for m in mtp_modules(parts):
        m.loss_scale = scale


def mtp_metrics(parts: list[nn.Module]) -> dict[str, float]:
    """This rank's `mtp/loss_k` of the step (means over its forwards), and reset; {} without MTP."""
    out: dict[str, float] = {}
    for m in mtp_modules(parts):
        out.update(m.take_metrics())
    return out
