"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, sec. 2.1; DeepSeek-V3 sec. 2.1.1).

Keys and values of every head are up-projected from one compressed latent c_KV (kv_lora_rank channels, RMS-
normed); position enters through a decoupled rotary key k_R (qk_rope_head_dim channels) that every head shares,
and the query of each head is [q_nope; RoPE(q_rope)], itself from a low-rank latent c_Q when q_lora_rank > 0:

    c_Q = norm(W_DQ x)      q = W_UQ c_Q  -> per head [q_C; RoPE(q_R)]
    [c_KV; k_R] = W_DKV x   k = [W_UK norm(c_KV); RoPE(k_R)]   v = W_UV norm(c_KV)

Parameter names are DeepSeek-V3's Hugging Face names (q_a_proj = W_DQ, q_a_layernorm, q_b_proj = W_UQ,
kv_a_proj_with_mqa = [W_DKV; W_KR], kv_a_layernorm, kv_b_proj = [W_UK; W_UV] per head, o_proj), so a checkpoint
maps one to one. RoPE is applied to interleaved channel pairs (`apply_rope`); DeepSeek's checkpoints store the
rotary rows in that order too (transformers' `rope_interleave=True`), and a permutation shared by q_R and k_R
leaves every score unchanged. The latent norms use eps 1e-6 as DeepSeek's reference code and transformers do.

Under tensor parallelism (framework/parallel/tensor.py) the down-projections and latent norms are replicated
and the up-projections split by heads; `shared_key_grad` then sums the shared rotary key's gradient over the tp
ranks. Generation caches the latent and the rotary key (kv_lora_rank + qk_rope_head_dim per token) instead of
per-head keys and values.

The attention itself is dense attention's (models/attention.py `attend`, or the `context_attention` hook context
parallelism installs): per-head q and k of N + R channels, values zero-padded to N + R (one head dim keeps the
flash kernels eligible; the extra output channels are zero and cut), and YaRN's extra softmax factor folded into
q, so the kernels' default scale 1/sqrt(N + R) applies. Document masks and every cp exchange (ring, all_to_all,
allgather) therefore hold for MLA as they do for GQA; under cp the exchanged K/V are per head (H x (N + R) x 2
numbers per token), not the compressed latent. Shape legend: B batch, T new positions, S attended positions, D
hidden, H heads (local under TP), C latent, R rotary channels, N no-position channels, V value channels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import DocumentMask, attend
from models.config import ModelConfig
from models.kv_cache import LayerKVCache
from models.layers import RMSNorm, apply_rope, masked_attention

LATENT_NORM_EPS = 1e-6


def score_gain(cfg: ModelConfig) -> float:
    """The softmax scale's factor on top of 1/sqrt(qk_head_dim): YaRN's mscale(factor, mscale_all_dim)^2 when set
    (DeepSeek scales the scores of the position-free channels too, not only the rotary ones: transformers'
    `yarn_apply_mscale`), else exactly 1."""
    rs = cfg.rope_scaling
    if rs.type != "none" and rs.mscale_all_dim and rs.factor > 1:
        m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
        return m * m
    return 1.0


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA through models/attention.py's kernels; the call is the dense `Attention`'s."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        h, d = cfg.n_heads, cfg.hidden
        self.nope, self.rope_dim, self.v_dim, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, \
            m.kv_lora_rank
        # The kernels scale scores by 1/sqrt(N + R); YaRN's mscale^2 on top of that multiplies the queries.
        self.q_gain = score_gain(cfg)
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * m.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * m.v_head_dim, d, bias=False)
        # Set by context parallelism (framework/parallel/context.py), as on dense attention: local (B, L, H, E)
        # q, k, v -> (B, L, H, E) attended across the cp ranks. None: single-device attention.
        self.context_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor] | None = None
        # Set by tensor parallelism: identity forward, gradient summed over tp in backward (Megatron's "f"): the
        # rotary key is replicated, and each tp rank's heads contribute only their share of its gradient.
        self.shared_key_grad: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x_BTD: torch.Tensor, rope: torch.Tensor, attn_mask: torch.Tensor | DocumentMask | None = None,
                kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        """`kv_cache` (generation) holds the latent (as keys) and the rotary key (as values) of earlier
        positions; the caller then passes the (B, 1, T, S) mask, as for dense attention."""
        b, t, _ = x_BTD.shape
        if self.q_proj is not None:
            q = self.q_proj(x_BTD)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_nope, q_rope = q.view(b, t, -1, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x_BTD).split([self.rank, self.rope_dim], dim=-1)
        latent_BT1C = self.kv_a_layernorm(latent).unsqueeze(2)
        k_rope_BT1R = apply_rope(k_rope.unsqueeze(2), rope)
        if self.shared_key_grad is not None:
            k_rope_BT1R = self.shared_key_grad(k_rope_BT1R)
        if kv_cache is not None:
            latent_BT1C, k_rope_BT1R = kv_cache.update(latent_BT1C, k_rope_BT1R)
        s = latent_BT1C.shape[1]
        kv = self.kv_b_proj(latent_BT1C.squeeze(2)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_BTHE = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        if self.q_gain != 1.0:
            q_BTHE = q_BTHE * self.q_gain
        k_BSHE = torch.cat([k_nope, k_rope_BT1R.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        v_BSHE = F.pad(v, (0, q_BTHE.shape[-1] - self.v_dim))
        if self.context_attention is not None:
            o_BTHE = self.context_attention(q_BTHE, k_BSHE, v_BSHE, attn_mask)
        else:
            q, k, v = (z.transpose(1, 2) for z in (q_BTHE, k_BSHE, v_BSHE))  # (B, H, T or S, E)
            if isinstance(attn_mask, torch.Tensor):
                o = masked_attention(q, k, v, attn_mask, expand_kv=False)
            else:
                o = attend(q, k, v, attn_mask)
            o_BTHE = o.transpose(1, 2)
        return self.o_proj(o_BTHE[..., :self.v_dim].reshape(b, t, -1))
