"""Autoregressive decoding from a Tessera checkpoint: batched prompts, greedy or sampled, with a KV cache.

    model, meta = load_generator(run_dir, device="cpu")
    out = generate(model, [[5, 17, 9], [4]], SamplingConfig(max_new_tokens=32), eos_id=2)

Prompts of different lengths are left-padded into one batch; each row's rotary positions count its own
tokens only (0..len-1) and padding is masked out of attention, so a batched prompt decodes exactly as it would
alone. The cache holds every layer's keys and values after RoPE (models/kv_cache.py): the prompt is one
forward (prefill), then each new token is one forward of length 1. Sampling follows the usual order —
temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020) — from a generator seeded by `seed`, so a
seed reproduces its samples on the same device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 decodes greedily)")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1 keeps every token)")


def filter_logits(logits_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set the logits outside the top-k / top-p (nucleus) set to -inf; at least one token always stays."""
    out = logits_BV
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def next_tokens(logits_BV: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    """(B,) next token ids from the last position's logits."""
    logits = logits_BV.float()
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


def _left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) token ids right-aligned, and the (B, P) mask of real (non-pad) tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        if p:
            ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            valid[row, width - len(p):] = True
    return ids.to(device), valid.to(device)


def _mask(valid_BS: torch.Tensor, t: int) -> torch.Tensor:
    """(B, 1, t, S) attention mask of the last t of S positions: causal, padding never attended; a padding
    query attends to itself so its (ignored) softmax row is never empty."""
    s = valid_BS.shape[1]
    q_pos = torch.arange(s - t, s, device=valid_BS.device)
    k_pos = torch.arange(s, device=valid_BS.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    allowed = causal[None] & valid_BS[:, None, :]
    allowed |= (k_pos[None, :] == q_pos[:, None])[None]
    return allowed[:, None]


@torch.no_grad()
def generate(model: Decoder, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, eos_id: int | None = None,
             on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """The new tokens of every prompt (without the prompt; with the EOS that ended a row, if any).

    Args:
        model: a one-process `Decoder` (all parts present), in eval mode.
        prompts: token ids, one list per row; rows may differ in length.
        on_token: called as on_token(row, token) for every token a row produces, as it is produced (streaming).
    """
    cfg.validate()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token; pass non-empty prompts")
    mcfg = model.cfg
    longest = max(len(p) for p in prompts)
    if longest + cfg.max_new_tokens > mcfg.max_seq_len:
        raise ConfigError(f"prompt of {longest} tokens + max_new_tokens={cfg.max_new_tokens} exceeds the model's "
                          f"max_seq_len={mcfg.max_seq_len}; shorten the prompt or lower max_new_tokens")
    device = next(model.parameters()).device
    ids, valid = _left_pad(prompts, device)
    b = ids.shape[0]
    gen = torch.Generator().manual_seed(cfg.seed) if cfg.temperature > 0 else None
    cache = None
    if cfg.use_cache:
        heads, key_dim, value_dim = cache_layout(mcfg)  # MLA: the compressed latent and the rotary key
        cache = KVCache(list(model.layers.keys()), b, ids.shape[1] + cfg.max_new_tokens,
                        heads, key_dim, next(model.parameters()).dtype, device, value_dim)
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    step_ids = ids
    for _ in range(cfg.max_new_tokens):
        positions_all = (valid.long().cumsum(-1) - 1).clamp(min=0)
        if cache is None:
            logits = model(ids, _mask(valid, ids.shape[1]), positions=positions_all)
        else:
            t = step_ids.shape[1]
            logits = model(step_ids, _mask(valid, t), positions=positions_all[:, -t:], kv_cache=cache)
        token = next_tokens(logits[:, -1], cfg, gen)
        token = torch.where(done, torch.full_like(token, PAD_ID), token)
        for row in range(b):
            if not done[row]:
                out[row].append(int(token[row]))
                if on_token is not None:
                    on_token(row, int(token[row]))
        if cfg.stop_at_eos and eos_id is not None:
            done |= token == eos_id
        if bool(done.all()):
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
        valid = torch.cat([valid, torch.ones_like(done)[:, None]], dim=1)
        step_ids = token[:, None]
    return out


def load_generator(path: Path, step: int | None = None, device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[Decoder, dict[str, Any]]:
    """The one-process model of any checkpoint (any layout: DCP reshards it on load), ready to decode."""
    from framework.checkpoint.hf import load_model, resolve_checkpoint

    module, meta = load_model(resolve_checkpoint(path, step))
    assert isinstance(module, Decoder)
    model = module
    model.to(device=torch.device(device))
    if dtype != torch.float32:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model.eval(), meta


