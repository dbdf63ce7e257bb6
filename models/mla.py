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
per-head keys and values. Shape legend: B batch, T new positions, S attended positions, D hidden, H heads
(local under TP), C latent, R rotary channels, N no-position channels, V value channels.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.kv_cache import LayerKVCache
from models.layers import RMSNorm, apply_rope

LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when set: DeepSeek scales the scores of
    the position-free channels too, not only the rotary ones (transformers' `yarn_apply_mscale`)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs.type != "none" and rs.mscale_all_dim and rs.factor > 1:
        m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
        scale *= m * m
    return scale


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA through `scaled_dot_product_attention`; the call is the dense `Attention`'s."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        h, d = cfg.n_heads, cfg.hidden
        self.nope, self.rope_dim, self.v_dim, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, \
            m.kv_lora_rank
        self.scale = softmax_scale(cfg)
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
        # Context parallelism's hook: the (B, L, 1, C) latent and (B, L, 1, R) rotary key -> the whole sequence's
        # (gathering the latent, not per-head K/V, moves C + R numbers per token instead of H x (N + R + V)).
        # framework/parallel/context.py installs `context_attention` hooks now, not this one, so MLA with cp is
        # refused at config load (framework/config.py) until it is wired there.
        self.kv_exchange: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        # Set by tensor parallelism: identity forward, gradient summed over tp in backward (Megatron's "f"): the
        # rotary key is replicated, and each tp rank's heads contribute only their share of its gradient.
        self.shared_key_grad: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x_BTD: torch.Tensor, rope: torch.Tensor, attn_mask: torch.Tensor | None = None,
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
        if self.kv_exchange is not None:
            latent_BT1C, k_rope_BT1R = self.kv_exchange(latent_BT1C, k_rope_BT1R)
        if kv_cache is not None:
            latent_BT1C, k_rope_BT1R = kv_cache.update(latent_BT1C, k_rope_BT1R)
        s = latent_BT1C.shape[1]
        kv = self.kv_b_proj(latent_BT1C.squeeze(2)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1).transpose(1, 2)  # (B, H, T, N + R)
        k = torch.cat([k_nope, k_rope_BT1R.expand(-1, -1, heads, -1)], dim=-1).transpose(1, 2)
        # The flash kernels (CPU's, and FlashAttention on CUDA) take one head dim for q, k and v: values padded
        # with zeros to the query/key dim keep the call eligible (the output's extra channels are zero and cut),
        # where unequal dims would fall back to the math kernel and its (B, H, T, S) score matrix.
        pad = q.shape[-1] - self.v_dim
        v = F.pad(v, (0, pad)).transpose(1, 2) if pad > 0 else v.transpose(1, 2)
        if attn_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)
        return self.o_proj(o[..., :self.v_dim].transpose(1, 2).reshape(b, t, -1))
