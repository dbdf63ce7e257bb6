"""Which attention kernel each mask takes, and the document mask every layer of one forward pass shares.

- No mask (plain causal): SDPA with `is_causal=True` and `enable_gqa`: flash on CUDA and CPU, K/V read at their
  own head count (no repeat to the query heads, for the kernel or for its saved tensors).
- Document masks: a `DocumentMask` built once per forward pass (Decoder.forward, one micro-batch) and handed to
  every layer. On CUDA it holds a FlexAttention `BlockMask` (torch.nn.attention.flex_attention): blocks of
  128 x 128 that cross a document boundary or the diagonal are masked per element, blocks fully outside are
  skipped, GQA is native, and backward keeps q, k, v, the output and its log-sum-exp only (torchtitan's document
  mask). On CPU, where FlexAttention has no backward, it holds one additive fp32 (B, 1, T, T) mask (0 / -inf)
  that SDPA's CPU flash kernel takes as is, with GQA, for every layer: the parity reference. (A bool mask would
  be converted to a float copy in every layer, each kept for backward.)
- An explicit tensor mask (generation with a KV cache): SDPA with that mask, `masked_attention` in models/layers.py.
Shape legend: B batch, T sequence, H query heads, K key/value heads, E head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch: document masks take the dense path everywhere
    BlockMask = None  # type: ignore[assignment, misc]
    create_block_mask = flex_attention = None  # type: ignore[assignment]


class DocumentMask:
    """Attention within one's own document, causal; one per forward pass, shared by all layers.

    Exactly one of `block` (FlexAttention block mask) and `dense` ((B, 1, T, T) additive fp32) is set.
    """

    def __init__(self, doc_BT: torch.Tensor, block: Any = None, dense: torch.Tensor | None = None) -> None:
        self.doc_BT, self.block, self.dense = doc_BT, block, dense


def block_sparse_available(device: torch.device) -> bool:
    """Whether document masks take FlexAttention on `device` (CUDA only: on CPU it has no backward)."""
    return device.type == "cuda" and flex_attention is not None


def document_mask_mod(doc_BT: torch.Tensor) -> Callable[..., torch.Tensor]:
    """FlexAttention mask_mod: key `kv` visible to query `q` of row `b` when causal and in the same document."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (doc_BT[b, q] == doc_BT[b, kv])

    return mask_mod


def dense_document_mask(doc_BT: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) additive fp32 mask, 0 where `document_mask_mod` allows, -inf elsewhere."""
    t = doc_BT.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_BT.device).tril()
    allowed = (doc_BT[:, :, None] == doc_BT[:, None, :]) & causal
    return torch.zeros(allowed.shape, device=doc_BT.device).masked_fill_(~allowed, float("-inf"))[:, None]


def document_mask(doc_BT: torch.Tensor, block_sparse: bool | None = None) -> DocumentMask:
    """The mask of one forward pass; `block_sparse` None chooses by device (`block_sparse_available`)."""
    if block_sparse is None:
        block_sparse = block_sparse_available(doc_BT.device)
    if block_sparse:
        b, t = doc_BT.shape
        block = create_block_mask(document_mask_mod(doc_BT), b, None, t, t, device=doc_BT.device)
        return DocumentMask(doc_BT, block=block)
    return DocumentMask(doc_BT, dense=dense_document_mask(doc_BT))


_compiled_flex: Callable[..., torch.Tensor] | None = None


def _flex(q: torch.Tensor) -> Callable[..., torch.Tensor]:
    """FlexAttention's fused kernel (compiled, as it must be on CUDA); the eager form elsewhere."""
    global _compiled_flex
    if q.device.type != "cuda":
        return flex_attention  # type: ignore[no-any-return]
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None) -> torch.Tensor:
    """Causal attention of q (B, H, T, E) to k, v (B, K, T, E), K dividing H; within documents with `mask`."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask.block is not None:
        return _flex(q)(q, k, v, block_mask=mask.block, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=gqa)


__all__ = ["BlockMask", "DocumentMask", "attend", "block_sparse_available", "dense_document_mask",
           "document_mask", "document_mask_mod"]


@torch.no_grad()
def max_logits(q_BTHE: torch.Tensor, k_BTKE: torch.Tensor, doc_BT: torch.Tensor | None = None,
               block: int = 1024) -> torch.Tensor:
    """(H,) each query head's largest attention logit q.k / sqrt(E) over the batch and the positions it may attend
    (causal, and within its document when `doc_BT` is given), in fp32: what QK-clip (MuonClip, Kimi K2, arXiv
    2507.20534) bounds. Head h reads key head h // (H / K) (GQA). Queries go `block` rows at a time, so the
    scores held at once are (B, H, block, T), not (B, H, T, T)."""
    _, t, h, e = q_BTHE.shape
    q = q_BTHE.float().transpose(1, 2)  # (B, H, T, E)
    k = k_BTKE.float().transpose(1, 2).repeat_interleave(h // k_BTKE.shape[2], dim=1)
    out = torch.full((h,), float("-inf"), device=q.device)
    keys = torch.arange(t, device=q.device)
    for start in range(0, t, block):
        rows = keys[start:start + block]
        scores = q[:, :, rows] @ k.transpose(-1, -2) / e**0.5  # (B, H, rows, T)
        allowed = keys[None, :] <= rows[:, None]  # (rows, T)
        if doc_BT is not None:
            allowed = allowed & (doc_BT[:, rows, None] == doc_BT[:, None, :])[:, None]
        out = torch.maximum(out, scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
    return out
