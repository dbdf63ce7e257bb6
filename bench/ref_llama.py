"""A plain-PyTorch Llama (no Tessera import): the reference the GPU check measures Tessera's framework tax against.

Written from the Llama architecture, not from Tessera's code: pre-norm blocks, RMSNorm in fp32, rotary
embeddings on interleaved channel pairs, grouped-query attention through SDPA (causal, enable_gqa), a SwiGLU MLP,
a head tied to the embedding or not. Parameter names are Tessera's FQNs, so `load_state_dict` takes a Tessera
model's weights and both compute the same logits (tests/models/test_ref_llama.py, fp32 on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, E): channels (2i, 2i+1) rotated by the angle of position t and frequency i, in fp32."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.e = heads, kv_heads, d // heads
        self.wq = nn.Linear(d, heads * self.e, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.e, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.e, bias=False)
        self.wo = nn.Linear(heads * self.e, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = rotate(self.wq(x).view(b, t, self.heads, self.e), cos, sin).transpose(1, 2)
        k = rotate(self.wk(x).view(b, t, self.kv_heads, self.e), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.e).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(ffn, d, bias=False), nn.Linear(
            d, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.attention, self.feed_forward = Attention(d, heads, kv_heads), FeedForward(d, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int, eps: float = 1e-5,
                 theta: float = 500000.0, tied: bool = False) -> None:
        super().__init__()
        self.theta, self.e = theta, d // heads
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): Block(d, heads, kv_heads, ffn, eps) for i in range(layers)})
        self.norm, self.output = RMSNorm(d, eps), nn.Linear(d, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        freq = self.theta ** -(torch.arange(0, self.e, 2, dtype=torch.float64, device=tokens.device) / self.e)
        angle = torch.outer(torch.arange(t, dtype=torch.float64, device=tokens.device), freq)
        cos, sin = (f(angle).float()[:, None, :] for f in (torch.cos, torch.sin))  # (T, 1, E/2)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
