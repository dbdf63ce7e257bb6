"""QK-clip, the "Clip" of MuonClip (Kimi K2, arXiv 2507.20534, Algorithm 1): after each optimizer step, for every
attention head h whose largest logit of the step S_h = max q.k / sqrt(d) passed tau, rescale its query and key
projections so that the same inputs would give tau:

    eta_h = min(1, tau / S_h)
    MHA:  W_q^h <- sqrt(eta_h) W_q^h,   W_k^h <- sqrt(eta_h) W_k^h          (the paper's alpha = 1/2)
    GQA:  a key head g is shared by its group's query heads: W_k^g <- sqrt(eta_g) W_k^g with eta_g the group's
          smallest eta, and W_q^h <- eta_h / sqrt(eta_g) W_q^h, so every head's logits scale by exactly eta_h
          (for MHA this is the paper's rule; biases of the projections scale with their rows)

    clip = QKClip.build(model_parts, model_cfg, train_cfg, head_offset, groups)  # None when off
    clip.after_optimizer_step(applied)                                            # both engines, every step

The attention modules record S_h per local head while training (`models.layers.Attention.track_max_logits`,
`models.attention.max_logits`: an extra no-grad q.k^T in query blocks, eager). Under TP a rank holds heads
[head_offset, head_offset + H/tp) of every layer it runs; data-parallel ranks see different batches and pipeline
stages different layers, so all-reducing (MAX) a (layers, heads) table over each mesh axis in turn (`groups`: the
mesh's own groups, a maximum over the whole mesh) gives every rank every head's maximum. Rows are rescaled on
the local pieces of the parameters whatever their placement (TP rows, FSDP shards, both): the scale vector is cut
like the parameter (`distribute_tensor` without communication). A step the loss guard or the fp16 scaler skips
clips nothing and forgets its maxima.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from framework.train.config import TrainConfig
from models.config import ModelConfig
from models.layers import Attention


class QKClip:
    """Per-head rescaling of wq/wk after the optimizer step (module docstring)."""

    def __init__(self, attention: dict[int, Attention], model_cfg: ModelConfig, tau: float, head_offset: int,
                 groups: Sequence[dist.ProcessGroup] = ()) -> None:
        self.attention, self.tau, self.head_offset, self.groups = attention, tau, head_offset, list(groups)
        self.n_layers, self.n_heads, self.n_kv = model_cfg.n_layers, model_cfg.n_heads, model_cfg.kv_heads
        self.head_dim = model_cfg.head_dim
        for module in attention.values():
            module.track_max_logits = True
        self.last_max: torch.Tensor | None = None
        """The (layers, heads) maxima of the last clipped step (-inf for layers no rank runs)."""

    @classmethod
    def build(cls, parts: Sequence[nn.Module], model_cfg: ModelConfig, train_cfg: TrainConfig, head_offset: int = 0,
              groups: Sequence[dist.ProcessGroup] = ()) -> QKClip | None:
        if not train_cfg.muon.qk_clip:
            return None
        attention = {int(m[1]): mod for part in parts for name, mod in part.named_modules()
                     if isinstance(mod, Attention) and (m := re.fullmatch(r"layers\.(\d+)\.attention", name))}
        return cls(attention, model_cfg, train_cfg.muon.qk_clip_tau, head_offset, groups)

    @torch.no_grad()
    def after_optimizer_step(self, applied: bool) -> None:
        if not applied:
            for module in self.attention.values():
                module.max_logits_H = None
            return
        table = torch.full((self.n_layers, self.n_heads), float("-inf"), device=self._device())
        for layer, module in self.attention.items():
            seen = module.max_logits_H
            if seen is not None:
                table[layer, self.head_offset:self.head_offset + seen.numel()] = seen
            module.max_logits_H = None
        for group in self.groups:  # one mesh axis after another: the maximum over the whole mesh
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        self.last_max = table
        eta = torch.where(table > self.tau, self.tau / table, 1.0)  # -inf (not seen) and logits under tau: 1
        for layer, module in self.attention.items():
            q_scale, k_scale = head_scales(eta[layer], self.n_kv)
            _scale_rows(module.wq, q_scale.repeat_interleave(self.head_dim))
            _scale_rows(module.wk, k_scale.repeat_interleave(self.head_dim))

    def _device(self) -> torch.device:
        module = next(iter(self.attention.values()), None)
        if module is None:
            return torch.device("cpu")
        w = module.wq.weight
        return w.to_local().device if isinstance(w, DTensor) else w.device


def head_scales(eta_H: torch.Tensor, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query-head scales (H,), key-head scales (K,)) that scale head h's logits by exactly eta_h (docstring)."""
    eta_g = eta_H.view(n_kv, -1).amin(dim=1)
    k_scale = eta_g.sqrt()
    return eta_H / k_scale.repeat_interleave(eta_H.numel() // n_kv), k_scale


def _scale_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Multiply each output row (and its bias) of `linear` by `rows` (global row order), on local pieces."""
    for p, scale in ((linear.weight, rows[:, None]), (linear.bias, rows)):
        if p is None:
            continue
        if isinstance(p, DTensor):
            # wq and wk are column-parallel: every placement cuts rows (dim 0), so an (R, 1) scale is cut alike
            assert all(getattr(pl, "dim", 0) == 0 for pl in p.placements), p.placements
            local = distribute_tensor(scale.contiguous(), p.device_mesh, p.placements, src_data_rank=None)
            p._local_tensor.mul_(local._local_tensor.to(p.dtype))
        else:
            p.mul_(scale.to(p.dtype))
