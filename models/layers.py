"""Building blocks of the decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU / GELU MLP.

Plain single-device PyTorch; parallelism is applied from outside (framework/parallel) by FQN.
Shape legend: B batch, T sequence, D hidden, H query heads, K key/value heads, E head dim, F ffn hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import DocumentMask, attend, max_logits
from models.config import ModelConfig, RopeScaling
from models.kv_cache import LayerKVCache
from models.rope import attention_factor, inv_freq


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None,
                scaling: RopeScaling | None = None) -> torch.Tensor:
    """cos/sin tables for rotary embeddings (Su et al. 2021), shape (max_seq_len, head_dim // 2, 2), fp32.

    `scaling`: context extension (models/rope.py); yarn also scales cos/sin by its attention factor.
    The last axis is (cos, sin) = (real, imag): `torch.view_as_complex` reads the table as the unit complex
    numbers e^{i t f} (times yarn's factor) without a copy, which is how `apply_rope` uses it.
    """
    inv = inv_freq(head_dim, theta, scaling, device)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    ang = torch.outer(t, inv)
    return (torch.stack([ang.cos(), ang.sin()], dim=-1) * attention_factor(scaling)).float()


def apply_rope(x_BTHE: torch.Tensor, rope_TE2: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels (interleaved, as Llama's complex formulation) by position-dependent angles.

    `rope_TE2` is the (max_seq_len, E/2, 2) fp32 table (positions 0..T-1) or a per-row gather of it,
    (B, T, E/2, 2), for positions that restart at document boundaries. One complex multiply in fp32 (as
    Meta's Llama and torchtitan): channel pairs (x0, x1) become x0 + i x1 times cos + i sin, both read as complex
    views without a copy; the result equals the real-valued rotation to fp32 rounding, in a fraction of its kernels.
    Under torch.compile the real-valued form is traced instead (one fused kernel).
    """
    b, t, h, e = x_BTHE.shape
    table = (rope_TE2[:t] if rope_TE2.dim() == 3 else rope_TE2).float().unsqueeze(-3)  # (T|B,T, 1, E/2, 2)
    x = x_BTHE.float().reshape(b, t, h, e // 2, 2)
    if torch.compiler.is_compiling():
        # Inductor generates no code for complex ops (it calls the eager kernels); the same product written
        # out in real arithmetic fuses into the surrounding kernel.
        cos, sin = table.unbind(-1)
        x0, x1 = x.unbind(-1)
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(3).type_as(x_BTHE)
    rot = torch.view_as_complex(table)
    return torch.view_as_real(torch.view_as_complex(x) * rot).flatten(3).type_as(x_BTHE)


class Attention(nn.Module):
    """Causal grouped-query attention: SDPA, or FlexAttention for document masks (models/attention.py)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        bias = cfg.mlp == "gelu"
        self.wq = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=bias or cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=bias or cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=bias or cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden, bias=bias)
        # Qwen3's per-head query/key norm (over the head's E channels, in Tessera's interleaved RoPE order)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # Set from outside by context parallelism (framework/parallel/context.py): attention of the local
        # (B, L, H, E) queries and (B, L, K, E) keys/values with the sequence split over cp ranks, given the mask
        # the decoder built; returns (B, L, H, E). None: single-device attention.
        self.context_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor] | None = None
        # QK-clip (framework/train/qk_clip.py) turns this on: each training forward raises `max_logits_H`, this
        # rank's heads' largest attention logit since the last clip, which the clip reads and resets.
        self.track_max_logits = False
        self.max_logits_H: torch.Tensor | None = None

    def forward(self, x_BTD: torch.Tensor, rope: torch.Tensor, attn_mask: torch.Tensor | DocumentMask | None = None,
                kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        """`attn_mask`: None (causal), the decoder's per-pass `DocumentMask`, or an explicit SDPA mask.
        `kv_cache` (generation): keys/values of earlier positions are prepended and this call's appended;
        the caller then passes the (B, 1, T, S) mask, since `is_causal` would align queries to key 0."""
        b, t, _ = x_BTD.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x_BTD).view(b, t, -1, self.head_dim)
        k = self.wk(x_BTD).view(b, t, -1, self.head_dim)
        v = self.wv(x_BTD).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.track_max_logits and self.training and kv_cache is None and not isinstance(attn_mask, torch.Tensor):
            seen = max_logits(q, k, attn_mask.doc_BT if isinstance(attn_mask, DocumentMask) else None)
            self.max_logits_H = seen if self.max_logits_H is None else torch.maximum(self.max_logits_H, seen)
        if self.context_attention is not None:
            return self.wo(self.context_attention(q, k, v, attn_mask).reshape(b, t, -1))
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, H, T, E); k, v (B, K, T, E)
        # GQA inside the kernels (torch >= 2.5): each group of H/K query heads reads its key/value head where it
        # lies; no repeat_interleave copy of k and v (and of their gradients) per layer. Local head counts: under
        # tp > n_kv_heads a rank holds one replicated KV head for its H/tp query heads.
        if isinstance(attn_mask, torch.Tensor):
            o = masked_attention(q, k, v, attn_mask, expand_kv=q.shape[1] != k.shape[1] and q.device.type == "cuda")
        else:
            o = attend(q, k, v, attn_mask)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor,
                     expand_kv: bool) -> torch.Tensor:
    """SDPA with an explicit mask (generation with a KV cache); q (B, H, T, E), k and v (B, K, S, E), K | H.

    `expand_kv` (on CUDA): the fused kernel that takes a mask there (memory-efficient attention) has no GQA, so
    `enable_gqa` with a mask would fall back to the math kernel, which materializes the whole (B, H, T, S) score
    matrix. Expanding k and v to the query heads keeps the fused kernel, at the cost of the (B, H, S, E) copies.
    CPU's flash kernel takes a mask and GQA together, and so does CUDA's flash kernel without a mask.
    """
    if expand_kv and q.shape[1] != k.shape[1]:
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=q.shape[1] != k.shape[1])


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x); or GELU MLP w2(gelu(w1 x)) for GPT blocks."""

    def __init__(self, cfg: ModelConfig, hidden_ffn: int | None = None) -> None:
        super().__init__()
        f = hidden_ffn or cfg.ffn
        self.gated = cfg.mlp == "swiglu"
        self.w1 = nn.Linear(cfg.hidden, f, bias=not self.gated)
        self.w2 = nn.Linear(f, cfg.hidden, bias=not self.gated)
        self.w3 = nn.Linear(cfg.hidden, f, bias=False) if self.gated else None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))
        return self.w2(F.gelu(self.w1(x_BTD), approximate="tanh"))
