"""Key/value cache for incremental decoding (generation only; training never builds one).

Shape legend: B batch, S cache capacity, T new positions, K key/value heads, E head dim.
Keys are cached after RoPE, in the (B, S, K, E) layout the attention projects them to, before the GQA
repetition, so a cache holds n_kv_heads (not n_heads) per layer. Multi-head latent attention (models/mla.py)
caches its compressed latent in the key slot and its shared rotary key in the value slot, one "head" of
kv_lora_rank and qk_rope_head_dim channels (576 numbers a token and layer for DeepSeek-V3, against 2 x 128 x 128
for its heads' keys and values), and up-projects them at every step (`cache_layout`).
"""

from __future__ import annotations

import torch

from models.config import ModelConfig


def cache_layout(cfg: ModelConfig) -> tuple[int, int, int]:
    """(heads, key channels, value channels) one cached position holds per layer."""
    if cfg.attention == "mla":
        return 1, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    return cfg.kv_heads, cfg.head_dim, cfg.head_dim


class LayerKVCache:
    """The cache of one attention layer: preallocated (B, S, K, E) keys and values, filled left to right."""

    def __init__(self, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, value_dim: int | None = None) -> None:
        self.k_BSKE = torch.zeros(batch, capacity, kv_heads, head_dim, dtype=dtype, device=device)
        self.v_BSKE = torch.zeros(batch, capacity, kv_heads, value_dim or head_dim, dtype=dtype, device=device)
        self.length = 0

    def update(self, k_BTKE: torch.Tensor, v_BTKE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions; return every cached position's keys and values, (B, length, K, E)."""
        t = k_BTKE.shape[1]
        end = self.length + t
        if end > self.k_BSKE.shape[1]:
            raise ValueError(f"KV cache holds {self.k_BSKE.shape[1]} positions; {end} requested")
        self.k_BSKE[:, self.length:end] = k_BTKE
        self.v_BSKE[:, self.length:end] = v_BTKE
        self.length = end
        return self.k_BSKE[:, :end], self.v_BSKE[:, :end]


class KVCache:
    """One `LayerKVCache` per decoder layer, keyed like `Decoder.layers`."""

    def __init__(self, layer_ids: list[str], batch: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 value_dim: int | None = None) -> None:
        dev = torch.device(device)
        self.layers = {i: LayerKVCache(batch, capacity, kv_heads, head_dim, dtype, dev, value_dim)
                       for i in layer_ids}
        self.capacity = capacity

    @property
    def length(self) -> int:
        """Positions cached so far (the same in every layer after a full forward)."""
        return next(iter(self.layers.values())).length if self.layers else 0

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (speculative decoding drops its rejected drafts); the next
        `update` overwrites them."""
        for layer in self.layers.values():
            layer.length = min(layer.length, length)
