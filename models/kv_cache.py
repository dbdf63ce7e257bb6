"""Key/value cache for incremental decoding (generation only; training never builds one).

Shape legend: B batch, S cache capacity, T new positions, K key/value heads, E head dim.
Keys are cached after RoPE, in the (B, S, K, E) layout the attention projects them to, before the GQA
repetition, so a cache holds n_kv_heads (not n_heads) per layer.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """The cache of one attention layer: preallocated (B, S, K, E) keys and values, filled left to right."""

    def __init__(self, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k_BSKE = torch.zeros(batch, capacity, kv_heads, head_dim, dtype=dtype, device=device)
        self.v_BSKE = torch.zeros_like(self.k_BSKE)
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
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        dev = torch.device(device)
        self.layers = {i: LayerKVCache(batch, capacity, kv_heads, head_dim, dtype, dev) for i in layer_ids}
        self.capacity = capacity

    @property
    def length(self) -> int:
        """Positions cached so far (the same in every layer after a full forward)."""
        return next(iter(self.layers.values())).length if self.layers else 0
