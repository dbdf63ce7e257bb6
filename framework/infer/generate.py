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
from dataclasses import dataclass, field
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


class _Output:
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
             on_token: Callable[[int, int], None] | None = None, trace: DecodeTrace | None = None
             ) -> list[list[int]]:
    """The new tokens of every prompt (without the prompt; with the EOS that ended a row, if any).

    Args:
        model: a one-process `Decoder` (all parts present), in eval mode.
        prompts: token ids, one list per row; rows may differ in length.
        on_token: called as on_token(row, token) for every token a row produces, as it is produced (streaming).
        trace: filled with the forward, draft and acceptance counts (and the logits, if it keeps them).
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
    out = _Output(ids.shape[0], cfg, eos_id, device, on_token, trace)
    if cfg.draft_tokens:
        from framework.infer.speculative import decode_speculative  # it builds on this module's helpers

        decode_speculative(model, ids, valid, cfg, out)
        return out.rows
    gen = torch.Generator().manual_seed(cfg.seed) if cfg.temperature > 0 else None
    cache = new_cache(model, ids.shape[0], ids.shape[1] + cfg.max_new_tokens) if cfg.use_cache else None
    step_ids = ids
    while True:
        positions_all = (valid.long().cumsum(-1) - 1).clamp(min=0)
        if cache is None:
            logits = model(ids, _mask(valid, ids.shape[1]), positions=positions_all)
        else:
            t = step_ids.shape[1]
            logits = model(step_ids, _mask(valid, t), positions=positions_all[:, -t:], kv_cache=cache)
        token = out.commit(next_tokens(logits[:, -1], cfg, gen), logits[:, -1])
        if out.finished:
            break
        if trace is not None:
            trace.forwards += 1
        ids = torch.cat([ids, token[:, None]], dim=1)
        valid = torch.cat([valid, torch.ones_like(out.done)[:, None]], dim=1)
        step_ids = token[:, None]
    return out.rows


def new_cache(model: Decoder, batch: int, capacity: int, layer_ids: list[str] | None = None) -> KVCache:
    """An empty KV cache for `model`'s layers (or `layer_ids`), in its parameters' dtype and device."""
    heads, key_dim, value_dim = cache_layout(model.cfg)  # MLA: the compressed latent and the rotary key
    param = next(model.parameters())
    ids = list(model.layers.keys()) if layer_ids is None else layer_ids
    return KVCache(ids, batch, capacity, heads, key_dim, param.dtype, param.device, value_dim)


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


