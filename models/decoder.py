"""The Llama-style decoder.

Layers live in an `nn.ModuleDict` keyed by layer index, and the embedding, final norm and head are optional
(`None`), so a pipeline stage is the same class with some parts removed: FQNs such as `layers.7.attention.wq`
stay stable across every layout, which is what checkpoints and per-FQN initialization key on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.attention import DocumentMask, document_mask
from models.config import ModelConfig
from models.init import copy_initial_into
from models.kv_cache import KVCache, LayerKVCache
from models.layers import Attention, FeedForward, build_norm, rope_tables
from models.mtp import MultiTokenPrediction


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = build_norm(cfg)
        self.attention: nn.Module = Attention(cfg)
        if cfg.attention == "mla":
            from models.mla import MultiHeadLatentAttention

            self.attention = MultiHeadLatentAttention(cfg)
        self.ffn_norm = build_norm(cfg)
        self.feed_forward: nn.Module
        if cfg.is_moe_layer(layer_id):
            from models.moe import MoE  # only MoE configs pay for it

            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x_BTD: torch.Tensor, rope: torch.Tensor, attn_mask: torch.Tensor | DocumentMask | None = None,
                kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        if kv_cache is None:  # the training call stays (x, rope, mask): TP's PrepareModuleInput counts inputs
            h = x_BTD + self.attention(self.attention_norm(x_BTD), rope, attn_mask)
        else:
            h = x_BTD + self.attention(self.attention_norm(x_BTD), rope, attn_mask, kv_cache=kv_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Token ids (B, T) -> logits (B, T, V); a pipeline stage maps hidden states instead where parts are None."""

    rope: torch.Tensor  # (max_seq_len, E/2, 2) fp32 buffer, registered in __init__

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.embeds_input = True
        """False on a pipeline stage after the first: its input is hidden states (an embedding it holds is the
        last stage's copy for multi-token prediction)."""
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = build_norm(cfg)
        self.output: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            assert self.output is not None and self.tok_embeddings is not None
            self.output.weight = self.tok_embeddings.weight
        self.mtp: MultiTokenPrediction | None = MultiTokenPrediction(cfg, Block) if cfg.mtp_depth else None
        self.register_buffer("rope", rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta,
                                                  scaling=cfg.rope_scaling), persistent=False)
        # doc_ids -> the mask every layer of one forward pass shares; context parallelism (framework/parallel/
        # context.py) sets its own, which knows which tokens this rank holds.
        self.mask_builder: Callable[[torch.Tensor], Any] = document_mask

    def forward(self, x: torch.Tensor, attn_mask: Any = None, *, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                mtp_labels: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) -> logits or hidden states.

        Args:
            x: (B, T) token ids, or (B, T, D) hidden states on a pipeline stage without the embedding.
            attn_mask: Optional SDPA mask broadcastable to (B, H, T, T); None means plain causal attention.
            doc_ids: (B, T) document index of every token (models/documents.py): attention stays within a
                document (`mask_builder`: a block mask or one dense mask, built once here and shared by every layer).
            positions: (B, T) rotary position of every token; None means 0..T-1 in every row.
            kv_cache: Generation only (framework/infer): the layers' cached keys/values of earlier positions;
                pass `positions` and an explicit (B, 1, T, S) `attn_mask` over all S cached + new positions.
            mtp_labels: (B, T) training labels: with `model.mtp_depth` the multi-token prediction modules run and
                their loss's gradient rides on the returned logits (models/mtp.py); None skips them (inference).
        """
        if doc_ids is not None:
            attn_mask = self.mask_builder(doc_ids)
        rope = self.rope if positions is None else self.rope[positions]  # (T, E/2, 2) or (B, T, E/2, 2)
        h = self._layers(x, rope, attn_mask, kv_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        if self.mtp is not None and mtp_labels is not None:
            assert self.tok_embeddings is not None, "MTP needs the embedding (under pp the last stage's copy)"
            logits = self.mtp(logits, h, mtp_labels, self.tok_embeddings, self.output, rope, attn_mask)
        return logits

    def _layers(self, x: torch.Tensor, rope: torch.Tensor, attn_mask: Any, kv_cache: KVCache | None) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None and self.embeds_input else x
        for key, layer in self.layers.items():
            if kv_cache is None:
                h = layer(h, rope, attn_mask)
            else:
                h = layer(h, rope, attn_mask, kv_cache.layers[key])
        return h

    def final_hidden(self, x: torch.Tensor, attn_mask: Any, positions: torch.Tensor,
                     kv_cache: KVCache | None = None) -> torch.Tensor:
        """(B, T, D) final-normed hidden states of token ids `x` (generation, one-process model): what the head
        turns into logits and what multi-token prediction's first depth reads (framework/infer/speculative.py)."""
        assert self.norm is not None
        return self.norm(self._layers(x, self.rope[positions], attn_mask, kv_cache))

    def _apply(self, fn: Any, recurse: bool = True) -> Decoder:
        # The RoPE table stays fp32 when the parameters are cast (model.to(torch.bfloat16)): apply_rope multiplies
        # in fp32, and a 16-bit table would lose precision in its angles and be copied back to fp32 at every call.
        rope = self.rope
        out = super()._apply(fn, recurse)
        if self.rope.dtype != rope.dtype and rope.device.type != "meta":
            self.rope = rope.to(device=self.rope.device)
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, device: torch.device | None = None) -> None:
        """Initialize every parameter from a generator seeded by (seed, FQN), on CPU, and the RoPE buffer.

        The values depend only on the seed and the parameter's name, never on the layout or rank, so a model
        built under any parallel layout holds bitwise the same full parameters as the 1-process model.
        Parameters that are DTensors receive their local shard of the full value, drawn without the full tensor.
        """
        device = device or self.rope.device
        if device.type == "meta":
            device = torch.device("cpu")
        self.rope = rope_tables(self.cfg.rope_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=device,
                                scaling=self.cfg.rope_scaling)
        for fqn, param in self.named_parameters():
            copy_initial_into(self.cfg, fqn, param, seed)
        for module in self.modules():  # state buffers (MoE routing bias) start from their reset value
            reset = getattr(module, "reset_buffers", None)
            if callable(reset):
                reset()


def build_model(cfg: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> Decoder:
    """Build and initialize a decoder; with `device="meta"` nothing is allocated (for large presets)."""
    with torch.device(device):
        model = Decoder(cfg)
    if torch.device(device).type != "meta":
        model.init_weights(seed)
    return model
