"""The pieces every decoding loop shares (plain greedy/sampled in generate.py, speculative in speculative.py): the
sampling config, the trace, the committed output with EOS and streaming, the attention mask, an empty cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from framework.base.errors import ConfigError
from models.decoder import Decoder
from models.kv_cache import KVCache, cache_layout

PAD_ID = 0
"""Id placed in the left padding; it is never attended to, so any valid id works."""


@dataclass(kw_only=True, frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 decodes greedily (argmax); > 0 divides the logits before sampling."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1: all)."""
    seed: int = 0
    stop_at_eos: bool = True
    use_cache: bool = True
    """False recomputes the whole sequence at every step (a reference for the cache; slow)."""
    draft_tokens: int = 0
    """Speculative decoding (framework/infer/speculative.py): the model's multi-token-prediction modules draft
    this many tokens (1..model.mtp_depth) and one forward verifies them; greedy only, the output is unchanged.
    0 decodes one token per forward."""

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 decodes greedily)")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1 keeps every token)")
        if self.draft_tokens < 0:
            raise ConfigError(f"draft_tokens={self.draft_tokens} must be >= 0 (0 decodes without drafts)")
        if self.draft_tokens and self.temperature > 0:
            raise ConfigError(f"draft_tokens={self.draft_tokens} verifies drafts greedily, but temperature="
                              f"{self.temperature}; set temperature=0 or draft_tokens=0")


@dataclass
class DecodeTrace:
    """What one `generate` call did (for tests, benches and the CLI's summary)."""

    forwards: int = 0
    """Model forwards after the prompt's."""
    drafted: int = 0
    """Draft tokens proposed (per row; a batch proposes the same count in every row)."""
    accepted: int = 0
    """Of which accepted: a batch advances by its live rows' smallest count."""
    keep: bool = False
    """Keep the logits below (tests: they are compared with the plain decode and the training path)."""
    logits: list[torch.Tensor] = field(default_factory=list)
    """The (B, V) logits every new token was chosen from, in order."""
    drafts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """Per verification: the newest committed position n and the (B, q, V) logits the drafts were chosen from."""


class Output:
    """The rows' new tokens as they are committed: streaming, EOS and the token budget in one place."""

    def __init__(self, batch: int, cfg: SamplingConfig, eos_id: int | None, device: torch.device,
                 on_token: Callable[[int, int], None] | None, trace: DecodeTrace | None) -> None:
        self.rows: list[list[int]] = [[] for _ in range(batch)]
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.cfg, self.eos_id, self.on_token, self.trace = cfg, eos_id, on_token, trace
        self.produced = 0

    @property
    def finished(self) -> bool:
        return self.produced >= self.cfg.max_new_tokens or bool(self.done.all())

    def commit(self, token_B: torch.Tensor, logits_BV: torch.Tensor) -> torch.Tensor:
        """Record one new token per row (finished rows get PAD_ID); returns the tokens to feed next."""
        token = torch.where(self.done, torch.full_like(token_B, PAD_ID), token_B)
        if self.trace is not None and self.trace.keep:
            self.trace.logits.append(logits_BV.detach().clone())
        for row in range(len(self.rows)):
            if not self.done[row]:
                self.rows[row].append(int(token[row]))
                if self.on_token is not None:
                    self.on_token(row, int(token[row]))
        if self.cfg.stop_at_eos and self.eos_id is not None:
            self.done |= token == self.eos_id
        self.produced += 1
        return token


def causal_mask(valid_BS: torch.Tensor, t: int) -> torch.Tensor:
    """(B, 1, t, S) attention mask of the last t of S positions: causal, padding never attended; a padding
    query attends to itself so its (ignored) softmax row is never empty."""
    s = valid_BS.shape[1]
    q_pos = torch.arange(s - t, s, device=valid_BS.device)
    k_pos = torch.arange(s, device=valid_BS.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    allowed = causal[None] & valid_BS[:, None, :]
    allowed |= (k_pos[None, :] == q_pos[:, None])[None]
    return allowed[:, None]


def new_cache(model: Decoder, batch: int, capacity: int, layer_ids: list[str] | None = None) -> KVCache:
    """An empty KV cache for `model`'s layers (or `layer_ids`), in its parameters' dtype and device."""
    heads, key_dim, value_dim = cache_layout(model.cfg)  # MLA: the compressed latent and the rotary key
    param = next(model.parameters())
    ids = list(model.layers.keys()) if layer_ids is None else layer_ids
    return KVCache(ids, batch, capacity, heads, key_dim, param.dtype, param.device, value_dim)
